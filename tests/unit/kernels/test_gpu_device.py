"""The GPU path on a real GPU: cupy's runtime, torch's streams and events, the copy
engines, the batched memcpy and the copy kernel. Skipped without a CUDA GPU and cupy.

The same checks the host executor (host_cuda.py) makes everywhere, made on the hardware:
- bytes: random models and jobs (test_kernels_cuda_property's strategies), every path
  forced and the rule's own choice, equal to the CPU path's (itself checked against the
  page-by-page reference);
- ordering: a store waits, on the GPU, for the engine's work recorded before it (the
  forward that wrote its blocks); a load waits for the engine zeroing its blocks; on the
  default stream and on a side stream;
- jobs in flight: kernel jobs queued behind the engine keep their descriptor buffers
  until they complete (a buffer reused early would copy another job's pieces).
`benchmarks/gpu_session.sh` runs these on a GPU machine, then again with each ordering
bug planted, which must fail them.
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_offload import FullAttentionSpec, KVCacheGroup, canonicalize
from kv_offload.kernels import BlockCopier, Direction, HostSlotLayout
from kv_offload.kernels.cuda_batch import MIN_DRIVER_VERSION
from kv_offload.store.host import HostTier
from kv_offload.testing.engine_alloc import allocate_kv_caches

from unit.kernels.test_cuda_property import job, models, run_path
from unit.kernels.test_kernels import randomize, reference_load, reference_store
from unit.store.host.test_cpu_backend import logical_pool

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
    reason="needs a CUDA GPU and cupy (pip install kv-offload[cuda])")
WAIT_S = 30
ENGINE_BUSY_S = 0.2  # how long the engine's stream spins before its own write


def engine_busy(seconds: float = ENGINE_BUSY_S) -> None:
    """Keep the current stream busy on the GPU (the forward still running)."""
    torch.cuda._sleep(int(seconds * _spin_cycles_per_s()))


@functools.cache
def _spin_cycles_per_s() -> float:
    """What `torch.cuda._sleep` spins per second on this GPU, timed once by events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    return 10**7 / (start.elapsed_time(end) / 1e3)


def gpu_model(num_blocks: int = 16, layers: int = 4):
    """A small model on the GPU, and the same model on the CPU for references."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    groups = [KVCacheGroup([f"l{i}" for i in range(layers)], spec)]
    buffer, caches = allocate_kv_caches(groups, num_blocks, "LBNHC", device="cuda")
    mirror, mirror_caches = allocate_kv_caches(groups, num_blocks, "LBNHC")
    return (buffer, canonicalize(caches, groups, num_blocks), mirror,
            canonicalize(mirror_caches, groups, num_blocks))


def run_on_gpu(groups, layout, num_blocks, num_slots, stores, loads, path):
    """`run_path` (same seeds, same steps) with engine memory on the GPU and the pool
    pinned: (pool after the store, engine bytes after the load), both on the CPU."""
    mirror, _ = allocate_kv_caches(groups, num_blocks, layout)
    buffer, caches = allocate_kv_caches(groups, num_blocks, layout, device="cuda")
    canonical = canonicalize(caches, groups, num_blocks)
    slot_layout = HostSlotLayout.from_canonical(canonical)
    pool = torch.empty(num_slots, slot_layout.slot_bytes, dtype=torch.int8, pin_memory=True)
    copier = BlockCopier(canonical, pool, slot_layout)
    if path == "batch" and not copier.runtime.batch_available:
        return None  # an older driver (test_the_real_driver_takes_the_batched_memcpy says)
    randomize(pool, 1)
    randomize(mirror, 2)
    buffer.copy_(mirror)
    copier.copy(copier.plan(Direction.STORE, stores), path)
    stored = pool.clone()
    randomize(mirror, 3)
    buffer.copy_(mirror)
    copier.copy(copier.plan(Direction.LOAD, loads), path)
    return stored, buffer.cpu(), copier.last_strategies(Direction.LOAD)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_gpu_path_leaves_the_bytes_of_the_cpu_path(data):
    groups, layout = data.draw(models())
    num_blocks, num_slots, stores, loads = data.draw(job(len(groups)))
    cpu_pool, cpu_buffer = run_path(groups, layout, num_blocks, num_slots, stores, loads, None)
    for path in ("dma", "batch", "kernel", None):
        result = run_on_gpu(groups, layout, num_blocks, num_slots, stores, loads, path)
        if result is None:
            continue
        pool, buffer, used = result
        assert path is None or used == (path,), f"asked for {path}, the copier used {used}"
        assert torch.equal(pool, cpu_pool), f"path {path or 'auto'}: wrong pool bytes"
        assert torch.equal(buffer, cpu_buffer), f"path {path or 'auto'}: wrong engine bytes"


def test_the_real_driver_takes_the_batched_memcpy():
    import cupy

    if cupy.cuda.runtime.driverGetVersion() < MIN_DRIVER_VERSION:
        pytest.skip("the driver predates CUDA 12.8: no batched memcpy to take")
    _, canonical, _, _ = gpu_model()
    pool = torch.empty(4, HostSlotLayout.from_canonical(canonical).slot_bytes,
                       dtype=torch.int8, pin_memory=True)
    copier = BlockCopier(canonical, pool)
    assert copier.runtime.batch_available, (
        "no cudaMemcpyBatchAsync here: cuda-bindings missing or a driver older than 12.8")


@pytest.fixture(params=["default stream", "side stream"])
def engine_stream(request):
    """The stream the engine runs its forward on (vLLM: the current stream)."""
    stream = torch.cuda.current_stream() if request.param == "default stream" else \
        torch.cuda.Stream()
    with torch.cuda.stream(stream):
        yield stream
    torch.cuda.synchronize()


def test_a_store_waits_on_the_gpu_for_the_forward_recorded_before_it(engine_stream):
    buffer, canonical, mirror, mirror_canonical = gpu_model()
    randomize(mirror, 7)  # what the forward writes
    forward = mirror.cuda()
    stores = {0: ([3, 4, 5, 9], [0, 1, 2, 7])}
    with HostTier(canonical, 12 * canonical.slot_bytes_per_block(0)) as backend:
        expected = reference_store(mirror_canonical, logical_pool(backend), stores)
        engine_busy()
        buffer.copy_(forward)  # the forward, still queued behind the busy stream
        job = backend.submit_store(stores, ready=backend.engine_ready())
        (result,) = backend.wait([job], timeout=WAIT_S)
        assert result.success
        assert torch.equal(logical_pool(backend), expected), \
            "the store copied the blocks before the forward wrote them"


def test_a_load_lands_after_the_engine_zeroes_its_blocks(engine_stream):
    buffer, canonical, mirror, mirror_canonical = gpu_model()
    randomize(mirror, 8)
    buffer.copy_(mirror)
    stores, loads = {0: ([1, 2, 6], [4, 5, 0])}, {0: ([10, 11, 12], [4, 5, 0])}
    with HostTier(canonical, 12 * canonical.slot_bytes_per_block(0)) as backend:
        assert backend.wait([backend.submit_store(stores, ready=backend.engine_ready())],
                            timeout=WAIT_S)[0].success
        mirror.zero_()
        expected = reference_load(mirror_canonical, logical_pool(backend), loads, mirror)
        engine_busy()
        buffer.zero_()  # the engine's own work on the new blocks, queued behind the spin
        job = backend.submit_load(loads, ready=backend.engine_ready())
        assert backend.wait([job], timeout=WAIT_S)[0].success
        assert torch.equal(buffer.cpu(), expected), \
            "the load landed before the engine's zeroing (or wrong bytes)"


def test_kernel_jobs_queued_together_keep_their_own_descriptors(engine_stream):
    buffer, canonical, mirror, mirror_canonical = gpu_model(num_blocks=64)
    randomize(mirror, 9)
    buffer.copy_(mirror)
    slot_layout = HostSlotLayout.from_canonical(canonical)
    pool = torch.zeros(64, slot_layout.slot_bytes, dtype=torch.int8, pin_memory=True)
    copier = BlockCopier(canonical, pool, slot_layout)
    rng = np.random.default_rng(5)
    engine_busy()  # every job below is enqueued before any can run
    ready = copier.engine_ready()
    expected, handles = pool.clone(), []
    for i in range(8):
        stores = {0: (rng.permutation(64)[:6].tolist(), list(range(8 * i, 8 * i + 6)))}
        expected = reference_store(mirror_canonical, expected, stores)
        handles.append(copier.submit(copier.plan(Direction.STORE, stores), ready, "kernel"))
    assert not handles[0].done(), "the engine's spin ended before the jobs were queued"
    assert copier.descriptor_pool.allocations >= 8  # one buffer per job in flight
    for handle in handles:
        handle.wait()
        assert handle.error is None
    assert torch.equal(pool, expected), "a job copied pieces that were not its own"
    before = copier.descriptor_pool.allocations
    for handle in [copier.submit(copier.plan(Direction.STORE, {0: ([0], [0])}), None,
                                 "kernel") for _ in range(4)]:
        handle.wait()
    assert copier.descriptor_pool.allocations == before  # completed jobs gave them back


def test_a_closed_backend_unpins_its_pool_so_the_next_backend_can_pin_one():
    """Backends one after another in one process (a connector restarted in place; any
    test run): each pins its pool, each close unpins it. Left pinned, a freed pool's
    range made the next pool that overlapped it fail to pin (seen on an H200)."""
    _, canonical, _, _ = gpu_model()
    for _ in range(5):
        backend = HostTier(canonical, 8 << 20)
        runtime, pool = backend.copier.runtime, backend.pool
        assert backend.pinned and runtime.page_locked(pool)
        backend.close()
        assert not runtime.page_locked(pool)


def test_blocks_go_from_the_gpu_to_disk_and_back_through_the_pinned_pool(tmp_path):
    """The whole tiered path on a GPU: stores into the page-locked pool, written through to
    files (O_DIRECT from page-locked memory), a new store over the same directory (a
    restarted engine: its own pool), files read into its pool and copied into other GPU
    blocks. A hybrid (attention + padded Mamba) laid out as LBHNC."""
    from unit.store.test_tiering import block_bytes, h, hybrid, make_store, wait_for_storage

    buffer, canonical = hybrid(device="cuda")
    expected = [block_bytes(canonical, g, b).cpu() for g, b in ((0, 1), (0, 3), (1, 2))]
    first = make_store(canonical, tmp_path, slots=6)
    assert first.cpu.pinned
    stores = {0: ([h(1), h(3)], [1, 3]), 1: ([h(2)], [2])}
    assert first.wait([first.submit_store(stores, ready=first.engine_ready())])[0].success
    first.flush()
    first.close()
    buffer.zero_()
    second = make_store(canonical, tmp_path, slots=6)
    wait_for_storage(second, [(h(1), 0), (h(3), 0), (h(2), 1)])
    loads = {0: ([h(3), h(1)], [9, 4]), 1: ([h(2)], [8])}
    [loaded] = second.wait([second.submit_load(loads, ready=second.engine_ready())])
    assert loaded.success
    assert torch.equal(block_bytes(canonical, 0, 4).cpu(), expected[0])
    assert torch.equal(block_bytes(canonical, 0, 9).cpu(), expected[1])
    assert torch.equal(block_bytes(canonical, 1, 8).cpu(), expected[2])
    second.close()
