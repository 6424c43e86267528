"""Spec types: page-size formulas, padding validation, merge rules."""

from __future__ import annotations

import pytest
import torch

from kv_offload import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SpecError,
    SpecMergeError,
    UniformTypeKVCacheSpecs,
)

ATTN = dict(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)


def test_attention_page_size_counts_k_and_v():
    spec = FullAttentionSpec(**ATTN)
    assert spec.head_size_v == 128
    assert spec.real_page_size_bytes == spec.page_size_bytes == 16 * 8 * 256 * 2


def test_different_v_head_size():
    spec = FullAttentionSpec(**ATTN, head_size_v=64)
    assert spec.page_size_bytes == 16 * 8 * (128 + 64) * 2


def test_mla_stores_one_latent_per_token():
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    assert spec.head_size_v == 0
    assert spec.page_size_bytes == 64 * 576 * 2


def test_padding_is_honoured_and_validated():
    spec = FullAttentionSpec(**ATTN, page_size_padded=70000)
    assert (spec.real_page_size_bytes, spec.page_size_bytes) == (65536, 70000)
    with pytest.raises(SpecError, match="page_size_padded=1000 is smaller than the real page"):
        FullAttentionSpec(**ATTN, page_size_padded=1000)


def test_mamba_page_is_the_sum_of_its_states():
    spec = MambaSpec(16, ((3, 8192), (32, 128, 128)), (torch.bfloat16, torch.float32))
    assert spec.state_sizes_bytes == (3 * 8192 * 2, 32 * 128 * 128 * 4)
    assert spec.page_size_bytes == sum(spec.state_sizes_bytes)
    padded = MambaSpec(16, spec.shapes, spec.dtypes, page_size_padded=3_000_000)
    assert padded.page_size_bytes == 3_000_000
    assert padded.real_page_size_bytes == spec.page_size_bytes
    with pytest.raises(SpecError, match="smaller than the real page"):
        MambaSpec(16, spec.shapes, spec.dtypes, page_size_padded=10)


@pytest.mark.parametrize("bad", [
    dict(block_size=0), dict(num_kv_heads=-1), dict(head_size=1.5), dict(dtype="bf16"),
])
def test_bad_values_are_typed_errors(bad):
    with pytest.raises(SpecError):
        FullAttentionSpec(**{**ATTN, **bad})


def test_mamba_needs_one_dtype_per_shape():
    with pytest.raises(SpecError, match="one dtype per state shape"):
        MambaSpec(16, ((3, 4), (5,)), (torch.float32,))


def test_local_attention_specs_need_their_window():
    with pytest.raises(SpecError, match="sliding_window"):
        SlidingWindowSpec(**ATTN, sliding_window=0)
    assert ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=8192).page_size_bytes == 65536
    with pytest.raises(SpecError, match="attention_chunk_size=24 must be a multiple of block"):
        ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=24)


def test_merge_identical_specs():
    spec = SlidingWindowSpec(**ATTN, sliding_window=1024)
    assert SlidingWindowSpec.merge([spec, spec]) == spec


def test_merge_rejects_disagreeing_layers_and_names_the_field():
    a = SlidingWindowSpec(**ATTN, sliding_window=1024)
    b = SlidingWindowSpec(**ATTN, sliding_window=512)
    with pytest.raises(SpecMergeError, match="sliding_window: 1024 vs 512"):
        SlidingWindowSpec.merge([a, b])
    with pytest.raises(SpecMergeError, match="mix spec types"):
        FullAttentionSpec.merge([FullAttentionSpec(**ATTN),
                                 MLAAttentionSpec(**{**ATTN, "num_kv_heads": 1})])


def test_full_attention_merge_unifies_recorded_windows():
    plain = FullAttentionSpec(**ATTN)
    windowed = FullAttentionSpec(**ATTN, sliding_window=4096)
    assert FullAttentionSpec.merge([plain, windowed]).sliding_window == 4096
    other = FullAttentionSpec(**ATTN, sliding_window=128)
    with pytest.raises(SpecMergeError, match="one sliding_window"):
        FullAttentionSpec.merge([windowed, other])
    with pytest.raises(SpecMergeError, match="head_size"):
        FullAttentionSpec.merge([plain, FullAttentionSpec(**{**ATTN, "head_size": 64})])


def test_uniform_type_specs_sum_their_layers():
    a, b = FullAttentionSpec(**ATTN), FullAttentionSpec(**{**ATTN, "num_kv_heads": 2})
    spec = UniformTypeKVCacheSpecs(16, {"a": a, "b": b})
    assert spec.page_size_bytes == a.page_size_bytes + b.page_size_bytes
    group = KVCacheGroup(["a", "b"], spec)
    assert group.layer_spec("b") is b
    with pytest.raises(SpecError, match="no spec for layer 'c'"):
        group.layer_spec("c")
    with pytest.raises(SpecError, match="block_size"):
        UniformTypeKVCacheSpecs(32, {"a": a})


def test_specs_are_frozen_and_hashable():
    spec = FullAttentionSpec(**ATTN)
    with pytest.raises(AttributeError):
        spec.block_size = 32
    assert len({spec, FullAttentionSpec(**ATTN)}) == 1
