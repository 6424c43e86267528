"""Property: any valid model allocated the vLLM 0.32 way canonicalises bit-exactly,
and the unique canonical tensors never share a byte."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_offload import (
    FullAttentionSpec,
    KVCacheGroup,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kv_offload.testing.engine_alloc import LAYOUTS, allocate_kv_caches

from helpers.byte_checks import canonicalize_and_check

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@st.composite
def layer_spec(draw, block_size: int):
    kind = draw(st.sampled_from(["full", "swa", "mla", "mamba"]))
    dtype = draw(st.sampled_from(DTYPES))
    if kind == "mamba":
        count = draw(st.integers(1, 2))
        shapes = tuple(
            tuple(draw(st.lists(st.sampled_from([2, 3, 8]), min_size=1, max_size=3))) + (8,)
            for _ in range(count)
        )
        return MambaSpec(block_size, shapes, tuple(draw(st.sampled_from(DTYPES))
                                                   for _ in shapes))
    heads = 1 if kind == "mla" else draw(st.integers(1, 3))
    common = dict(block_size=block_size, num_kv_heads=heads, dtype=dtype,
                  head_size=draw(st.sampled_from([8, 16, 24])))
    if kind == "mla":
        return MLAAttentionSpec(**common)
    if kind == "swa":
        return SlidingWindowSpec(**common, sliding_window=draw(st.integers(1, 100)))
    return FullAttentionSpec(**common)


def padded(spec, page: int):
    """The same spec with its page padded to `page` bytes (hybrid page unification)."""
    if page == spec.real_page_size_bytes:
        return spec
    fields = {**spec.__dict__, "page_size_padded": page}
    return type(spec)(**fields)


@st.composite
def models(draw):
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    block_size = draw(st.sampled_from([16, 32]))
    num_blocks = draw(st.integers(1, 4))
    specs = [draw(layer_spec(block_size)) for _ in range(draw(st.integers(1, 3)))]
    layers = draw(st.integers(1, 3))
    block_outer = LAYOUTS[layout][0] == 1
    if len(specs) > 1 and not block_outer:
        # vLLM overlays layer-outer groups only with one unified page size.
        page = -(-max(s.real_page_size_bytes for s in specs) // 16) * 16
        specs = [padded(s, page) for s in specs]
    groups = [KVCacheGroup([f"g{g}.l{i}" for i in range(layers)], s) for g, s in enumerate(specs)]
    kernel = []
    for spec in specs:
        split = (not block_outer and block_size == 32 and not isinstance(spec, MambaSpec)
                 and spec.page_size_bytes == spec.real_page_size_bytes and draw(st.booleans()))
        kernel.append(16 if split else None)
    return groups, num_blocks, layout, kernel


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models())
def test_random_models_round_trip_bit_exact(model):
    groups, num_blocks, layout, kernel = model
    _, caches = allocate_kv_caches(groups, num_blocks, layout, kernel)
    canonical = canonicalize_and_check(caches, groups, num_blocks)
    for g, group in enumerate(groups):
        real = sum(group.layer_spec(n).real_page_size_bytes for n in group.layer_names)
        assert canonical.data_bytes_per_block(g) == real
