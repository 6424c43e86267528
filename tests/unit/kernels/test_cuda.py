"""The GPU copy path, executed on the host, byte for byte.

`CudaCopier` runs unchanged against `HostCudaRuntime` (host_cuda.py), a host executor
of the CUDA runtime calls written from the documentation: CPU tensors stand in for
device memory (the calls only see addresses), the copy kernel is the very source
string the copier hands to the runtime, built for the host (host_kernel.py). Every
example model, all four layouts, both directions, every group, runs longer than one
block (2D copies with height > 1), aligned and unaligned pieces, more pieces than
`MAX_GRID`, each path forced: 2D copies, the batched memcpy, the kernel. The
reference is the page-by-page copy of test_kernels.py. The tests at the end need a
real GPU and skip without one.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from kv_offload import FullAttentionSpec, KVCacheGroup, canonicalize
from kv_offload.kernels import BlockCopier, Direction, HostSlotLayout
from kv_offload.kernels.cuda import MAX_GRID
from kv_offload.store.host import HostTier
from kv_offload.testing.engine_alloc import LAYOUTS, allocate_kv_caches
from kv_offload.testing.example_models import EXAMPLE_MODELS, build_example, group_layers

from helpers.host_cuda import HostCudaRuntime
from helpers.host_kernel import compiler
from unit.kernels.test_kernels import randomize, reference_load, reference_store, small_hybrid
from unit.store.host.test_cpu_backend import logical_pool

PATHS = ["dma", "batch", "kernel"]

needs_compiler = pytest.mark.skipif(compiler() is None,
                                    reason="needs a C++ compiler to build the copy kernel")
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
    reason="needs a CUDA GPU and cupy (pip install kv-offload[cuda])",
)


def host_copier(canonical, engine_buffers, num_slots, *, runtime=None, pool_shift=0):
    """A BlockCopier on the GPU code path, over host memory: the pool from the
    runtime's pinned memory (shifted by `pool_shift` bytes to unalign it)."""
    runtime = runtime or HostCudaRuntime()
    for buffer in engine_buffers:
        runtime.register(buffer)
    layout = HostSlotLayout.from_canonical(canonical)
    raw = runtime.pinned_empty(num_slots * layout.slot_bytes + pool_shift)
    pool = raw[pool_shift:].view(torch.int8).view(num_slots, layout.slot_bytes)
    randomize(pool, 99)
    return BlockCopier(canonical, pool, layout, runtime=runtime), runtime


def runs_and_scatter(rng, ids: np.ndarray, run: int) -> list[int]:
    """`ids` (consecutive) with the first `run` in order and the rest shuffled."""
    ids = list(ids)
    rest = ids[run:]
    rng.shuffle(rest)
    return ids[:run] + rest


def jobs(rng, num_groups: int, per_group: int, num_blocks: int, num_slots: int):
    """Stores and loads for every group, on disjoint blocks (groups overlay each
    other's bytes), each with a run of consecutive blocks -> consecutive slots."""
    run = min(per_group, 3)
    stores, loads = {}, {}
    chunks = num_blocks // per_group
    assert chunks > num_groups and num_slots >= num_groups * per_group
    block_base = rng.permutation(num_groups)
    slot_base = rng.permutation(num_slots // per_group)[:num_groups]
    for g in range(num_groups):
        blocks = runs_and_scatter(rng, np.arange(per_group) + block_base[g] * per_group, run)
        slots = runs_and_scatter(rng, np.arange(per_group) + slot_base[g] * per_group, run)
        stores[g] = (blocks, slots)
        targets = np.arange(per_group) + (block_base[g] + 1) % chunks * per_group
        loads[g] = (runs_and_scatter(rng, targets, run), slots)
    return stores, loads


def check_round_trip(copier, canonical, buffer, stores, loads, path, seed=0):
    """Store, compare the pool; scribble; load, compare the whole engine buffer."""
    randomize(buffer, seed + 1)
    expected_pool = reference_store(canonical, copier.pool, stores)
    copier.copy(copier.plan(Direction.STORE, stores), path)
    if path is not None:
        assert copier.last_strategies(Direction.STORE) == (path,)
    assert torch.equal(copier.pool, expected_pool)
    randomize(buffer, seed + 2)
    expected = reference_load(canonical, copier.pool, loads, buffer)
    copier.copy(copier.plan(Direction.LOAD, loads), path)
    assert torch.equal(buffer, expected)  # loaded bytes right, every other byte untouched
    assert torch.equal(copier.pool, expected_pool)


@needs_compiler
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(EXAMPLE_MODELS))
def test_example_models_move_byte_exact_through_the_gpu_path(name, layout, path):
    groups = group_layers(EXAMPLE_MODELS[name]())
    per_group = 2 if name == "qwen3-next" else 3  # 13 MB per block: keep it small
    num_blocks = (len(groups) + 1) * per_group
    model = build_example(name, num_blocks, layout=layout)
    canonical = canonicalize(model.kv_caches, model.groups, num_blocks)
    copier, runtime = host_copier(canonical, [model.buffer], len(groups) * per_group + 2)
    stores, loads = jobs(np.random.default_rng(len(name)), len(groups), per_group,
                         num_blocks, copier.num_slots)
    check_round_trip(copier, canonical, model.buffer, stores, loads, path)
    if path == "dma":  # runs moved as multi-row 2D copies
        assert max(call[7] for call in runtime.calls if call[0] == "memcpy2d") > 1
    assert runtime.count("synchronize") == 2 and runtime.sticky_error is None


@needs_compiler
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_unaligned_pieces_and_an_unaligned_pool(path, layout):
    caches, groups, buffer = small_hybrid(layout, 12)  # 3 groups, pages not 16-byte multiples
    canonical = canonicalize(caches, groups, 12)
    assert any(r.page_size_bytes % 16 for refs in canonical.group_refs for r in refs)
    copier, _ = host_copier(canonical, [buffer], 11, pool_shift=3)
    assert copier.pool.data_ptr() % 16 == 3
    stores, loads = jobs(np.random.default_rng(1), len(groups), 3, 12, copier.num_slots)
    check_round_trip(copier, canonical, buffer, stores, loads, path)


@needs_compiler
def test_kernel_covers_more_pieces_than_the_grid():
    """16-byte pages of 40 layers: 1700 blocks are 68000 pieces, more than MAX_GRID
    thread blocks, so blocks of the grid loop over several pieces."""
    spec = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=4, dtype=torch.float16)
    groups = [KVCacheGroup([f"l{i}" for i in range(40)], spec)]
    num_blocks = 1700
    buffer, caches = allocate_kv_caches(groups, num_blocks, "LBNHC")
    canonical = canonicalize(caches, groups, num_blocks)
    copier, runtime = host_copier(canonical, [buffer], num_blocks)
    rng = np.random.default_rng(2)
    blocks, slots = rng.permutation(num_blocks).tolist(), rng.permutation(num_blocks).tolist()
    targets = rng.permutation(num_blocks).tolist()
    check_round_trip(copier, canonical, buffer, {0: (blocks, slots)}, {0: (targets, slots)},
                     "kernel")
    grids = [call[2] for call in runtime.calls if call[0] == "launch"]
    assert grids == [MAX_GRID, MAX_GRID] and num_blocks * 40 > MAX_GRID


@needs_compiler
def test_the_kernel_takes_one_block_per_multiprocessor_at_most():
    """On a device of 7 SMs, 4 x 32 pieces are copied by 7 thread blocks looping over
    them (a larger grid moved no more bytes on an H200; it only takes SMs)."""
    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8, dtype=torch.float16)
    groups = [KVCacheGroup([f"l{i}" for i in range(32)], spec)]
    buffer, caches = allocate_kv_caches(groups, 12, "LBNHC")
    canonical = canonicalize(caches, groups, 12)
    runtime = HostCudaRuntime(multiprocessors=7)
    copier, _ = host_copier(canonical, [buffer], 8, runtime=runtime)
    check_round_trip(copier, canonical, buffer, {0: ([9, 2, 5, 0], [1, 6, 3, 0])},
                     {0: ([4, 11, 7, 1], [1, 6, 3, 0])}, "kernel")
    assert [call[2] for call in runtime.calls if call[0] == "launch"] == [7, 7]


@needs_compiler
def test_backend_on_the_gpu_path_round_trips_every_group():
    model = build_example("gemma3", 8)
    canonical = canonicalize(model.kv_caches, model.groups, 8)
    runtime = HostCudaRuntime()
    runtime.register(model.buffer)
    randomize(model.buffer, 4)
    with HostTier(canonical, 6 << 20, runtime=runtime) as backend:
        stores = {0: ([5, 1, 2], [3, 0, 4]), 4: ([7], [5])}
        expected_pool = reference_store(canonical, logical_pool(backend), stores)
        assert backend.wait([backend.submit_store(stores)])[0].success
        assert torch.equal(logical_pool(backend), expected_pool)
        randomize(model.buffer, 5)
        loads = {0: ([7, 6, 3], [3, 0, 4]), 4: ([0], [5])}
        expected = reference_load(canonical, logical_pool(backend), loads, model.buffer)
        assert backend.wait([backend.submit_load(loads)])[0].success
        assert torch.equal(model.buffer, expected)


# --- on a real GPU only ---


def cpu_mirror(groups, num_blocks, layout):
    """The same model allocated on the CPU: the reference runs there."""
    buffer, mirror = allocate_kv_caches(groups, num_blocks, layout)
    return buffer, canonicalize(mirror, groups, num_blocks)


@needs_gpu
@pytest.mark.parametrize("strategy", PATHS + [None])
@pytest.mark.parametrize("name", ["llama-8b", "qwen3-next"])
@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_gpu_round_trip_matches_cpu_reference(name, layout, strategy):
    groups = group_layers(EXAMPLE_MODELS[name]())
    num_blocks = 2 * (len(groups) + 1)
    gpu_buffer, caches = allocate_kv_caches(groups, num_blocks, layout, device="cuda")
    canonical = canonicalize(caches, groups, num_blocks)
    cpu_buffer, cpu_canonical = cpu_mirror(groups, num_blocks, layout)
    layout_ = HostSlotLayout.from_canonical(canonical)
    pool = torch.empty(2 * len(groups) + 2, layout_.slot_bytes, dtype=torch.int8,
                       pin_memory=True)
    randomize(pool, 2)
    copier = BlockCopier(canonical, pool, layout_)
    if strategy == "batch" and not copier.runtime.batch_available:
        pytest.skip("this driver has no cudaMemcpyBatchAsync (CUDA < 12.8 or no cuda-bindings)")
    stores, loads = jobs(np.random.default_rng(0), len(groups), 2, num_blocks, pool.shape[0])
    randomize(cpu_buffer, 1)
    gpu_buffer.copy_(cpu_buffer)
    expected_pool = reference_store(cpu_canonical, pool, stores)
    copier.copy(copier.plan(Direction.STORE, stores), strategy)
    assert torch.equal(pool, expected_pool)
    randomize(cpu_buffer, 3)
    gpu_buffer.copy_(cpu_buffer)
    expected = reference_load(cpu_canonical, pool, loads, cpu_buffer)
    copier.copy(copier.plan(Direction.LOAD, loads), strategy)
    assert torch.equal(gpu_buffer.cpu(), expected)


@needs_gpu
def test_backend_on_gpu_pins_and_round_trips():
    groups = group_layers(EXAMPLE_MODELS["gemma3"]())
    gpu_buffer, caches = allocate_kv_caches(groups, 8, "LBNHC", device="cuda")
    canonical = canonicalize(caches, groups, 8)
    cpu_buffer, cpu_canonical = cpu_mirror(groups, 8, "LBNHC")
    randomize(cpu_buffer, 4)
    gpu_buffer.copy_(cpu_buffer)
    with HostTier(canonical, 6 << 20) as backend:
        assert backend.pinned and backend.copier.runtime.page_locked(backend.pool)
        stores = {0: ([5, 1, 2], [3, 0, 4])}
        expected_pool = reference_store(cpu_canonical, logical_pool(backend), stores)
        ready = backend.engine_ready()
        assert backend.wait([backend.submit_store(stores, ready=ready)])[0].success
        assert torch.equal(logical_pool(backend), expected_pool)
        gpu_buffer.zero_()
        cpu_buffer.zero_()
        loads = {0: ([7, 6, 3], [3, 0, 4])}
        expected = reference_load(cpu_canonical, logical_pool(backend), loads, cpu_buffer)
        assert backend.wait([backend.submit_load(loads, ready=backend.engine_ready())])[0].success
        assert torch.equal(gpu_buffer.cpu(), expected)


@needs_compiler
@pytest.mark.parametrize("path", PATHS)
def test_a_single_block_cache_whose_layers_fuse_into_one_wide_row(path):
    """One block, two 2-byte layer pages back to back: the segment is one 4-byte row
    whose row stride is 2. CUDA refuses a 2D copy with width > pitch even for one
    row (found by the property test); the copier must not issue one."""
    spec = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=1, dtype=torch.int8)
    groups = [KVCacheGroup(["a", "b"], spec)]
    buffer, caches = allocate_kv_caches(groups, 1, "LBHNC")
    canonical = canonicalize(caches, groups, 1)
    copier, _ = host_copier(canonical, [buffer], 1)
    assert copier.segments[0][0].engine.stride(0) < copier.segments[0][0].block_bytes
    check_round_trip(copier, canonical, buffer, {0: ([0], [0])}, {0: ([0], [0])}, path)
