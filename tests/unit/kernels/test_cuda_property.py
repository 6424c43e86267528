"""Random valid models, random jobs: the CPU path, and the GPU path's 2D copies,
batched memcpy and copy kernel (executed on the host, see test_kernels_cuda.py),
leave identical bytes, equal to the page-by-page reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_offload import (
    FullAttentionSpec,
    KVCacheGroup,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    canonicalize,
)
from kv_offload.kernels import BlockCopier, Direction, HostSlotLayout
from kv_offload.testing.engine_alloc import LAYOUTS, allocate_kv_caches

from helpers.host_cuda import HostCudaRuntime
from helpers.host_kernel import compiler
from unit.kernels.test_kernels import randomize, reference_load, reference_store

PATHS = [None, "dma", "batch", "kernel"]  # None: the CPU path
DTYPES = [torch.int8, torch.float16, torch.bfloat16, torch.float32]


@st.composite
def models(draw):
    """1-3 groups of equal page size (vLLM's rule for hybrids): an attention group
    (full, sliding window or MLA; maybe padded), then attention or Mamba groups
    padded to that page."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    heads = draw(st.integers(1, 3))
    head = draw(st.integers(1, 12))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["full", "swa", "mla"]))
    common = dict(block_size=block_size, head_size=head, dtype=dtype)
    if kind == "mla":
        base = MLAAttentionSpec(num_kv_heads=1, **common)
    elif kind == "swa":
        base = SlidingWindowSpec(num_kv_heads=heads, sliding_window=4 * block_size, **common)
    else:
        base = FullAttentionSpec(num_kv_heads=heads, **common)
    pad = draw(st.sampled_from([0, 0, 4, 13])) * dtype.itemsize  # views need whole elements
    if pad:
        base = type(base)(**{**_fields(base), "page_size_padded": base.page_size_bytes + pad})
    page = base.page_size_bytes
    layers = draw(st.integers(1, 3))
    specs = [base]
    for _ in range(draw(st.integers(0, 2))):
        if page >= 4 and draw(st.booleans()):  # two int8 states, padded up to the page
            real = draw(st.integers(1, page // 2))
            states = ((real,), (page // 2 + 1 - real,))
            specs.append(MambaSpec(block_size=block_size, shapes=states,
                                   dtypes=(torch.int8, torch.int8), page_size_padded=page))
        else:
            specs.append(base)
    groups = [KVCacheGroup([f"g{g}.l{i}" for i in range(layers)], spec)
              for g, spec in enumerate(specs)]
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    return groups, layout


def _fields(spec) -> dict:
    from dataclasses import fields

    return {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}


@st.composite
def job(draw, num_groups: int):
    """Disjoint blocks per group (groups overlay their bytes), slots anywhere;
    permutations with runs kept (drawn as sorted stretches, then shuffled a bit)."""
    per_group = draw(st.integers(1, 5))
    num_blocks = num_groups * per_group + draw(st.integers(0, 4))
    num_slots = num_groups * per_group + draw(st.integers(0, 4))
    blocks = draw(st.permutations(range(num_blocks)))
    if draw(st.booleans()):
        blocks = sorted(blocks[:num_groups * per_group]) + blocks[num_groups * per_group:]
    slots = draw(st.permutations(range(num_slots)))
    targets = draw(st.permutations(range(num_blocks)))
    n = num_groups * per_group
    stores = {g: (blocks[g:n:num_groups], slots[g:n:num_groups]) for g in range(num_groups)}
    loads = {g: (targets[g:n:num_groups], slots[g:n:num_groups]) for g in range(num_groups)}
    return num_blocks, num_slots, stores, loads


def run_path(groups, layout, num_blocks, num_slots, stores, loads, path):
    """Store then load through one path; returns (pool after the store, engine
    buffer after the load) and checks both against the reference."""
    buffer, caches = allocate_kv_caches(groups, num_blocks, layout)
    canonical = canonicalize(caches, groups, num_blocks)
    layout_ = HostSlotLayout.from_canonical(canonical)
    runtime = None
    if path is None:
        pool = torch.empty(num_slots, layout_.slot_bytes, dtype=torch.int8)
    else:
        runtime = HostCudaRuntime()
        runtime.register(buffer)
        pool = runtime.pinned_empty(num_slots * layout_.slot_bytes).view(torch.int8).view(
            num_slots, layout_.slot_bytes)
    randomize(pool, 1)
    randomize(buffer, 2)
    copier = BlockCopier(canonical, pool, layout_, runtime=runtime)
    expected_pool = reference_store(canonical, pool, stores)
    copier.copy(copier.plan(Direction.STORE, stores), path)
    assert torch.equal(pool, expected_pool)
    randomize(buffer, 3)
    expected = reference_load(canonical, pool, loads, buffer)
    copier.copy(copier.plan(Direction.LOAD, loads), path)
    assert torch.equal(buffer, expected)
    return pool.clone(), buffer.clone()


@pytest.mark.skipif(compiler() is None, reason="needs a C++ compiler to build the copy kernel")
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cpu_dma_batch_and_kernel_paths_leave_identical_bytes(data):
    groups, layout = data.draw(models())
    num_blocks, num_slots, stores, loads = data.draw(job(len(groups)))
    results = [run_path(groups, layout, num_blocks, num_slots, stores, loads, path)
               for path in PATHS]
    pool, buffer = results[0]
    for other_pool, other_buffer in results[1:]:
        assert np.array_equal(pool.numpy(), other_pool.numpy())
        assert np.array_equal(buffer.numpy(), other_buffer.numpy())
