"""How the GPU path picks 2D copies, the batched memcpy or the kernel (one rule,
`cuda_calls.choose_path`), the batched memcpy through the copier on the host
executor, and our call into NVIDIA's real cuda-python binding."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from kv_offload import canonicalize
from kv_offload.errors import CudaCallError, TransferError
from kv_offload.kernels import BlockCopier, Direction, HostSlotLayout
from kv_offload.kernels.cuda_calls import (
    DMA_BYTES_PER_US,
    KERNEL_BYTES_PER_US,
    KERNEL_CHUNK_BYTES,
    KERNEL_LAUNCH_US,
    KERNEL_MIN_CHUNK_BYTES,
    MEMCPY_CALL_US,
    Memcpy2DCalls,
    Path,
    choose_path,
    kernel_chunk_bytes,
)
from kv_offload.kernels.runtime import DEFAULT_MAX_PITCH, MemcpyAttributes
from kv_offload.testing.example_models import build_example

from helpers.host_cuda import HostCudaRuntime
from helpers.host_kernel import compiler
from unit.kernels.test_kernels import randomize, reference_store

KiB, MiB = 1 << 10, 1 << 20


def calls(count: int, width: int, height: int = 1, pitch: int | None = None) -> Memcpy2DCalls:
    """`count` 2D calls of `height` rows of `width` bytes (rows `pitch` apart)."""
    pitch = pitch or 2 * width
    addresses = np.arange(count, dtype=np.int64) * (height * pitch)
    return Memcpy2DCalls(addresses, pitch, addresses + (1 << 40), pitch, width,
                         np.full(count, height, dtype=np.int64))


@pytest.mark.parametrize("work, batch, expected", [
    (calls(1, 2 * MiB), False, Path.DMA),  # one large copy
    (calls(1, 2 * MiB), True, Path.DMA),  # ... the batch is never the rule's choice
    (calls(32, 64 * KiB, height=64), True, Path.DMA),  # a long prompt, consecutive: 32 calls
    (calls(32, 2 * KiB), True, Path.DMA),  # one block of 32 small pages: 32 calls
    (calls(64, 2 * KiB), True, Path.KERNEL),  # two scattered blocks of them: 64 calls
    (calls(256, 64 * KiB), True, Path.KERNEL),  # 8 scattered blocks of 32 layers
    (calls(2, 1 * KiB, height=100), False, Path.DMA),  # 2 calls: the engines walk the rows
    (calls(100, 1 * MiB), False, Path.DMA),  # big copies hide the enqueue cost
    (calls(4, 64 * KiB, pitch=DEFAULT_MAX_PITCH + 1), True, Path.KERNEL),  # no 2D copy
    (calls(0, 64 * KiB), False, Path.DMA),
])
def test_choose_path_follows_the_measured_costs(work, batch, expected):
    assert choose_path(work, batch_available=batch, max_pitch=DEFAULT_MAX_PITCH) is expected


def test_the_rule_is_the_cheaper_of_its_two_costs():
    """Around the crossover: the 2D calls win exactly while their cost is the lower."""
    for count in range(1, 200):
        work = calls(count, 64 * KiB)
        dma = count * MEMCPY_CALL_US + work.num_bytes / DMA_BYTES_PER_US
        kernel = KERNEL_LAUNCH_US + work.num_bytes / KERNEL_BYTES_PER_US
        expected = Path.DMA if dma <= kernel else Path.KERNEL
        assert choose_path(work, batch_available=True, max_pitch=DEFAULT_MAX_PITCH) is expected
    assert choose_path(calls(1, 64 * KiB), batch_available=True,
                       max_pitch=DEFAULT_MAX_PITCH) is Path.DMA
    assert choose_path(calls(199, 64 * KiB), batch_available=True,
                       max_pitch=DEFAULT_MAX_PITCH) is Path.KERNEL


@pytest.mark.parametrize("total, chunk", [
    (0, KERNEL_MIN_CHUNK_BYTES), (2 * MiB, KERNEL_MIN_CHUNK_BYTES), (16 * MiB, 16 * KiB),
    (256 * MiB, KERNEL_CHUNK_BYTES), (16 * MiB + 7, 16 * KiB)])
def test_small_kernel_jobs_are_cut_finer(total, chunk):
    assert kernel_chunk_bytes(total) == chunk and chunk % 16 == 0


def test_rows_contiguous_on_both_sides_are_one_copy():
    dense = calls(3, 4 * KiB, height=5, pitch=4 * KiB)
    assert dense.copies.count == 3 and dense.copies.size.tolist() == [20 * KiB] * 3
    strided = calls(3, 4 * KiB, height=5)
    assert strided.copies.count == 15
    assert strided.copies.dst[:3].tolist() == [0, 8 * KiB, 16 * KiB]


def test_chunks_cover_every_byte_once_and_keep_their_alignment():
    whole = calls(3, 100 * KiB + 3, height=2).copies
    chunks = whole.chunked(64 * KiB)
    assert chunks.count == 12 and int(chunks.size.max()) == 64 * KiB
    expected = sorted((s + k, d + k, min(64 * KiB, n - k))
                      for s, d, n in zip(whole.src.tolist(), whole.dst.tolist(),
                                         whole.size.tolist())
                      for k in range(0, n, 64 * KiB))
    assert sorted(zip(chunks.src.tolist(), chunks.dst.tolist(),
                      chunks.size.tolist())) == expected


@pytest.mark.parametrize("forced, batch, pitch, message", [
    ("dma", True, DEFAULT_MAX_PITCH + 1, "the device allows at most"),
    ("batch", False, 4 * KiB, "not available"),
    ("warp", True, 4 * KiB, "unknown GPU copy strategy 'warp'"),
])
def test_an_impossible_forced_path_is_a_typed_error(forced, batch, pitch, message):
    with pytest.raises(TransferError, match=message):
        choose_path(calls(2, 1 * KiB, pitch=pitch), batch_available=batch,
                    max_pitch=DEFAULT_MAX_PITCH, forced=forced)


def llama_on_host(batch: bool, layout: str):
    model = build_example("llama-8b", 8, layout=layout)
    randomize(model.buffer, 1)
    canonical = canonicalize(model.kv_caches, model.groups, 8)
    runtime = HostCudaRuntime(batch=batch)
    runtime.register(model.buffer)
    slot_bytes = HostSlotLayout.from_canonical(canonical).slot_bytes
    pool = runtime.pinned_empty(8 * slot_bytes).view(torch.int8).view(8, slot_bytes)
    return BlockCopier(canonical, pool, runtime=runtime), runtime, canonical


@pytest.mark.skipif(compiler() is None, reason="needs a C++ compiler to build the copy kernel")
@pytest.mark.parametrize("batch, layout, expected", [
    (True, "LBNHC", ("kernel",)),  # 32 layer pages per block apart: 128 calls
    (False, "LBNHC", ("kernel",)),
    (True, "BLNHC", ("dma",)),  # a block's layers are one dense row: 4 2D calls
    (False, "BLNHC", ("dma",)),
])
def test_the_rule_on_the_copier_never_takes_the_batch_itself(batch, layout, expected):
    copier, runtime, canonical = llama_on_host(batch, layout)
    stores = {0: ([6, 1, 3, 4], [0, 2, 5, 7])}
    expected_pool = reference_store(canonical, copier.pool, stores)
    copier.copy(copier.plan(Direction.STORE, stores))
    assert copier.last_strategies(Direction.STORE) == expected
    assert torch.equal(copier.pool, expected_pool)
    assert runtime.count("batch") == (1 if expected == ("batch",) else 0)


needs_bindings = pytest.mark.skipif(
    importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None,
    reason="needs NVIDIA's cuda-bindings (pip install cuda-bindings)")


def _driver_version() -> int:
    from cuda.bindings import runtime as cudart

    return cudart.cudaDriverGetVersion()[1]


@needs_bindings
def test_our_batch_call_is_accepted_by_the_real_binding():
    """Without a driver the binding still checks every argument's type and count
    before calling into CUDA: a CudaCallError naming the driver (not a TypeError)
    proves the call we make matches the binding's signature."""
    from cuda.bindings import runtime as cudart

    from kv_offload.kernels.cuda_batch import BatchMemcpy, load_batch_memcpy

    if _driver_version() != 0:
        pytest.skip("a CUDA driver is present: the batched memcpy runs in the GPU tests")
    assert load_batch_memcpy(0) is None  # no 12.8+ driver: the copier will not use it
    batch = BatchMemcpy(cudart, 0)
    array = np.array([4096, 8192], dtype=np.int64)
    with pytest.raises(CudaCallError, match="cudaSetDevice failed: cudaError"):
        batch(array, array + 64, np.array([16, 16]), [MemcpyAttributes()], [0], 7)
    batch._thread.bound = True  # past the device call, into the batched memcpy itself
    with pytest.raises(CudaCallError, match="cudaMemcpyBatchAsync failed: cudaError"):
        batch(array, array + 64, np.array([16, 16]), [MemcpyAttributes()], [0], 7)
    made = batch._attributes(MemcpyAttributes(device=0))
    assert int(made.srcAccessOrder) == 1 and int(made.flags) == 1
    assert int(made.srcLocHint.type) == 1 and int(made.dstLocHint.type) == 2


def test_the_submit_benchmark_counts_the_calls_each_path_issues():
    import sys
    from pathlib import Path as FilePath

    sys.path.insert(0, str(FilePath(__file__).parents[3] / "benchmarks"))
    from bench_cuda_submit import measure

    rows = {(r["pattern"], r["path"]): r["calls"] for r in measure("llama-8b", "BLNHC", 8, 1)}
    assert rows[("runs", "dma")]["memcpy2d"] == 1  # 8 consecutive blocks: one 2D call
    assert rows[("scattered", "batch")]["batch"] == 1
    assert rows[("scattered", "kernel")]["launch"] == 1
