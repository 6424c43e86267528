"""GPU copies (DMA and the copy kernel) against the CPU page-by-page reference.
Runs only where CUDA and cupy are present."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from test_kernels import randomize, reference_load, reference_store

from kv_offload import canonicalize
from kv_offload.backends.cpu import CpuBackend
from kv_offload.engine_alloc import allocate_kv_caches
from kv_offload.example_models import EXAMPLE_MODELS, group_layers
from kv_offload.kernels import BlockCopier, Direction, HostSlotLayout

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
    reason="needs a CUDA GPU and cupy (pip install kv-offload[cuda])",
)


def cpu_mirror(caches, groups, num_blocks, layout):
    """The same model allocated on the CPU: the reference runs there."""
    buffer, mirror = allocate_kv_caches(groups, num_blocks, layout)
    return buffer, canonicalize(mirror, groups, num_blocks)


@needs_gpu
@pytest.mark.parametrize("strategy", ["dma", "kernel", None])
@pytest.mark.parametrize("name", ["llama-8b", "qwen3-next"])
@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_gpu_round_trip_matches_cpu_reference(name, layout, strategy):
    groups = group_layers(EXAMPLE_MODELS[name]())
    num_blocks = 6
    gpu_buffer, caches = allocate_kv_caches(groups, num_blocks, layout, device="cuda")
    canonical = canonicalize(caches, groups, num_blocks)
    cpu_buffer, cpu_canonical = cpu_mirror(caches, groups, num_blocks, layout)
    randomize(cpu_buffer, 1)
    gpu_buffer.copy_(cpu_buffer)
    layout_ = HostSlotLayout.from_canonical(canonical)
    pool = torch.empty(len(groups) + 2, layout_.slot_bytes, dtype=torch.int8, pin_memory=True)
    randomize(pool, 2)
    copier = BlockCopier(canonical, pool, layout_)
    rng = np.random.default_rng(0)
    blocks = rng.permutation(num_blocks)[:len(groups)].tolist()
    slots = rng.permutation(pool.shape[0])[:len(groups)].tolist()
    stores = {g: ([blocks[g]], [slots[g]]) for g in range(len(groups))}
    expected_pool = reference_store(cpu_canonical, pool, stores)
    copier.copy(copier.plan(Direction.STORE, stores), strategy)
    assert torch.equal(pool, expected_pool)

    randomize(cpu_buffer, 3)
    gpu_buffer.copy_(cpu_buffer)
    targets = rng.permutation(num_blocks)[:len(groups)].tolist()
    loads = {g: ([targets[g]], [slots[g]]) for g in range(len(groups))}
    expected = reference_load(cpu_canonical, pool, loads, cpu_buffer)
    copier.copy(copier.plan(Direction.LOAD, loads), strategy)
    assert torch.equal(gpu_buffer.cpu(), expected)


@needs_gpu
def test_backend_on_gpu_pins_and_round_trips():
    groups = group_layers(EXAMPLE_MODELS["gemma3"]())
    gpu_buffer, caches = allocate_kv_caches(groups, 8, "LBNHC", device="cuda")
    canonical = canonicalize(caches, groups, 8)
    cpu_buffer, cpu_canonical = cpu_mirror(caches, groups, 8, "LBNHC")
    randomize(cpu_buffer, 4)
    gpu_buffer.copy_(cpu_buffer)
    with CpuBackend(canonical, 6 << 20) as backend:
        assert backend.pool.is_pinned()
        stores = {0: ([5, 1, 2], [3, 0, 4])}
        expected_pool = reference_store(cpu_canonical, backend.pool, stores)
        assert backend.wait([backend.submit_store(stores)])[0].success
        assert torch.equal(backend.pool, expected_pool)
        gpu_buffer.zero_()
        cpu_buffer.zero_()
        loads = {0: ([7, 6, 3], [3, 0, 4])}
        expected = reference_load(cpu_canonical, backend.pool, loads, cpu_buffer)
        assert backend.wait([backend.submit_load(loads)])[0].success
        assert torch.equal(gpu_buffer.cpu(), expected)


@pytest.mark.parametrize("name", ["llama-8b", "qwen3-next"])
@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_gpu_descriptors_address_the_right_bytes(name, layout):
    """The DMA calls and kernel pieces the GPU path would issue, executed here
    with memmove on CPU memory (no GPU needed), match the reference."""
    import ctypes

    from kv_offload.kernels.cuda import _dma_calls, _pieces

    groups = group_layers(EXAMPLE_MODELS[name]())
    buffer, caches = allocate_kv_caches(groups, 5, layout)
    canonical = canonicalize(caches, groups, 5)
    randomize(buffer, 5)
    layout_ = HostSlotLayout.from_canonical(canonical)
    pool = torch.zeros(6, layout_.slot_bytes, dtype=torch.int8)
    copier = BlockCopier(canonical, pool, layout_)
    stores = {0: ([4, 0, 1, 2], [5, 1, 2, 3])}  # a run of three and a single
    expected_pool = reference_store(canonical, pool, stores)
    (group_plan,) = copier.plan(Direction.STORE, stores).groups
    for segment in copier.segments[0][:1]:
        dst, dpitch, src, widths, heights, spitch = _dma_calls(segment.engine, segment.host,
                                                               group_plan)
        for d, s, w, h in zip(dst.tolist(), src.tolist(), widths.tolist(), heights.tolist()):
            for row in range(h):
                ctypes.memmove(d + row * dpitch, s + row * spitch, w)
    for segment in copier.segments[0][1:]:
        for s, d, n in _pieces(segment.engine, segment.host, group_plan).tolist():
            ctypes.memmove(d, s, n)
    assert torch.equal(pool, expected_pool)
    randomize(buffer, 6)
    loads = {0: ([3, 4, 0, 1], [5, 1, 2, 3])}
    expected = reference_load(canonical, pool, loads, buffer)
    (group_plan,) = copier.plan(Direction.LOAD, loads).groups
    for segment in copier.segments[0]:
        for s, d, n in _pieces(segment.host, segment.engine, group_plan).tolist():
            ctypes.memmove(d, s, n)
    assert torch.equal(buffer, expected)
