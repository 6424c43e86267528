"""canonicalize(): every supported engine layout, bit for bit, and every refusal."""

from __future__ import annotations

import pytest
import torch

from kv_offload import (
    CanonicalizationError,
    FullAttentionSpec,
    KVCacheGroup,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    canonicalize,
)
from kv_offload.testing.engine_alloc import (
    LAYOUTS,
    allocate_kv_caches,
    legacy_mamba_states,
    legacy_split_kv,
    uniform_group,
)
from kv_offload.testing.example_models import build_example, group_layers

from helpers.byte_checks import canonicalize_and_check as check

ATTN = dict(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)


def names(prefix, n):
    return [f"{prefix}.{i}" for i in range(n)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_vllm_attention_views_of_one_buffer(layout):
    spec = FullAttentionSpec(**ATTN)
    groups = [KVCacheGroup(names("attn", 3), spec)]
    buffer, caches = allocate_kv_caches(groups, 5, layout)
    assert all(c.untyped_storage().data_ptr() == buffer.data_ptr() for c in caches.values())
    canonical = check(caches, groups, 5)
    assert len(canonical.tensors) == 3
    assert [r.page_size_bytes for r in canonical.group_refs[0]] == [spec.page_size_bytes] * 3
    assert all(r.offset_bytes == 0 for r in canonical.group_refs[0])


@pytest.mark.parametrize("kv_outer", [True, False])
@pytest.mark.parametrize("num_blocks", [1, 3, 6])
def test_legacy_split_kv(kv_outer, num_blocks):
    spec = FullAttentionSpec(**ATTN)
    caches = legacy_split_kv(spec, num_blocks, 2, kv_outer=kv_outer)
    groups = [KVCacheGroup(list(caches), spec)]
    canonical = check(caches, groups, num_blocks)
    refs = canonical.group_refs[0]
    if kv_outer and num_blocks > 1:
        # K and V of a block live apart: two pages per layer, K then V.
        assert [r.page_size_bytes for r in refs] == [spec.page_size_bytes // 2] * 4
    else:
        assert [r.page_size_bytes for r in refs] == [spec.page_size_bytes] * 2


def test_split_kv_with_two_blocks_is_refused_as_ambiguous():
    spec = FullAttentionSpec(**ATTN)
    caches = legacy_split_kv(spec, 2, 1, kv_outer=True)
    with pytest.raises(CanonicalizationError, match="ambiguous"):
        canonicalize(caches, [KVCacheGroup(list(caches), spec)], 2)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_mla_latents(layout):
    model = build_example("deepseek-mla", 2, layout=layout)
    canonical = check(model.kv_caches, model.groups, 2, sample=3)
    assert canonical.data_bytes_per_block(0) == 61 * 64 * 576 * 2


def test_mamba_int8_pages_with_padded_stride():
    spec = MambaSpec(block_size=32, shapes=((3, 40), (4, 8, 8)),
                     dtypes=(torch.bfloat16, torch.float32), page_size_padded=2048)
    groups = [KVCacheGroup(names("mamba", 2), spec)]
    buffer, caches = allocate_kv_caches(groups, 4)
    cache = caches["mamba.0"]
    assert cache.dtype == torch.int8 and cache.shape == (4, 1, 1, spec.real_page_size_bytes)
    assert cache.stride(0) == 2048
    canonical = check(caches, groups, 4)
    ref = canonical.group_refs[0][0]
    assert (ref.page_size_bytes, ref.slot_bytes) == (spec.real_page_size_bytes, 2048)


def test_legacy_mamba_state_list():
    spec = MambaSpec(block_size=32, shapes=((3, 40), (4, 8, 8)),
                     dtypes=(torch.bfloat16, torch.float32), page_size_padded=2048)
    _, caches = legacy_mamba_states(spec, 3, 2)
    groups = [KVCacheGroup(list(caches), spec)]
    canonical = check(caches, groups, 3)
    assert [r.page_size_bytes for r in canonical.group_refs[0]] == [spec.real_page_size_bytes] * 2


def test_legacy_mamba_states_with_a_gap_are_refused():
    spec = MambaSpec(block_size=32, shapes=((4,), (4,)), dtypes=(torch.float32,) * 2)
    page = torch.zeros(3, 12, dtype=torch.float32)  # 16 data bytes + 16 bytes of gap... misplaced
    states = [page[:, 0:4], page[:, 8:12]]
    with pytest.raises(CanonicalizationError, match="back to back"):
        canonicalize({"m": states}, [KVCacheGroup(["m"], spec)], 3)


def test_padded_attention_pages_copy_only_real_bytes():
    spec = FullAttentionSpec(**ATTN, page_size_padded=5000)
    groups = [KVCacheGroup(names("attn", 2), spec)]
    _, caches = allocate_kv_caches(groups, 3, "LBHNC")
    assert caches["attn.0"].stride(0) * 2 == 5000
    canonical = check(caches, groups, 3)
    ref = canonical.group_refs[0][0]
    assert (ref.page_size_bytes, ref.slot_bytes) == (spec.real_page_size_bytes, 5000)
    assert canonical.slot_bytes_per_block(0) == 10000


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_kernel_block_splitting(layout):
    spec = FullAttentionSpec(**{**ATTN, "block_size": 128})
    groups = [KVCacheGroup(names("attn", 2), spec)]
    _, caches = allocate_kv_caches(groups, 3, layout, kernel_block_sizes=[32])
    assert caches["attn.0"].shape[0] == 12  # 4 kernel blocks per manager block
    canonical = check(caches, groups, 3)
    assert canonical.tensors[0].page_size_bytes == spec.page_size_bytes


def test_kernel_blocks_that_are_not_adjacent_are_refused():
    spec = FullAttentionSpec(**{**ATTN, "block_size": 64})  # 8 KiB pages
    buffer = torch.zeros(6 * 8192, dtype=torch.int8)
    # 6 kernel blocks of 32 tokens (4 KiB each), but spaced 8 KiB apart.
    view = buffer.as_strided((6, 2, 32, 64), (8192, 2048, 64, 1)).view(torch.bfloat16)
    with pytest.raises(CanonicalizationError, match="not adjacent"):
        canonicalize({"a": view}, [KVCacheGroup(["a"], spec)], 3)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_overlaid_groups_share_tensors(layout):
    model = build_example("gemma3", 2, layout=layout)
    # 48 layers -> 6 groups of 8 overlaying the same 8 tensors.
    canonical = check(model.kv_caches, model.groups, 2, sample=3)
    assert len(canonical.tensors) == 8
    for refs in canonical.group_refs:
        assert sorted(r.tensor_idx for r in refs) == list(range(8))


def test_hybrid_attention_mamba_with_padding_and_kernel_blocks():
    # Full size, in the layout vLLM's CPU backend uses; other layouts: the small hybrid below.
    model = build_example("qwen3-next", 2, layout="LBHNC")
    canonical = check(model.kv_caches, model.groups, 2, sample=2)
    assert len(canonical.tensors) == 12
    mamba = next(g for g, grp in enumerate(model.groups) if isinstance(grp.spec, MambaSpec))
    attn = next(g for g, grp in enumerate(model.groups) if not isinstance(grp.spec, MambaSpec))
    ref_m, ref_a = canonical.group_refs[mamba][0], canonical.group_refs[attn][0]
    assert ref_m.tensor_idx == ref_a.tensor_idx
    assert ref_m.page_size_bytes < ref_m.slot_bytes == ref_a.page_size_bytes


def test_alias_names_outside_groups_and_shared_layers_inside():
    spec = FullAttentionSpec(**ATTN)
    groups = [KVCacheGroup(["a", "b", "c"], spec)]  # "c" shares "a"'s cache (vLLM appends it)
    _, caches = allocate_kv_caches([KVCacheGroup(["a", "b"], spec)], 3)
    caches["c"] = caches["a"]
    caches["d"] = caches["b"]  # in kv_caches, in no group
    canonical = check(caches, groups, 3)
    assert len(canonical.group_refs[0]) == 2  # the shared bytes are moved once


def test_unknown_extra_layer_is_refused():
    spec = FullAttentionSpec(**ATTN)
    groups = [KVCacheGroup(["a"], spec)]
    _, caches = allocate_kv_caches(groups, 3)
    caches["stray"] = torch.zeros(3, 2, 32, 32, dtype=torch.bfloat16)
    with pytest.raises(CanonicalizationError, match="'stray'.*in no cache group"):
        canonicalize(caches, groups, 3)


def test_uniform_type_group_with_different_head_counts():
    small = FullAttentionSpec(**ATTN)
    big = FullAttentionSpec(**{**ATTN, "num_kv_heads": 4})
    group = uniform_group(32, {"a": small, "b": big})
    _, caches = allocate_kv_caches([group], 3, "BLNHC")
    canonical = check(caches, [group], 3)
    assert canonical.data_bytes_per_block(0) == small.page_size_bytes + big.page_size_bytes


def test_block_outer_mixed_pages_across_groups_are_merged_with_offsets():
    # Group 0 packs [A | B], group 1 packs [C | D] in every block; A and C differ
    # in size, so B and D overlap without starting together (DeepSeek-V4 style).
    a = FullAttentionSpec(**ATTN)
    b = FullAttentionSpec(**{**ATTN, "num_kv_heads": 4})
    c = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=48, dtype=torch.bfloat16)
    d = SlidingWindowSpec(**{**ATTN, "num_kv_heads": 3}, sliding_window=64)
    groups = [uniform_group(32, {"A": a, "B": b}), uniform_group(32, {"C": c, "D": d})]
    _, caches = allocate_kv_caches(groups, 3, "BLHNC")
    canonical = check(caches, groups, 3)
    offsets = {r.layer_name: r.offset_bytes for refs in canonical.group_refs for r in refs}
    assert len(canonical.tensors) == 1
    assert offsets == {"A": 0, "B": a.page_size_bytes, "C": 0, "D": c.page_size_bytes}


def test_head_outer_layout_is_refused_with_layer_details():
    spec = FullAttentionSpec(**ATTN)
    # [H, B, N, C] physical order: one block's bytes are split per head.
    raw = torch.zeros(2, 3, 32, 32, dtype=torch.bfloat16)
    view = raw.permute(1, 0, 2, 3)
    with pytest.raises(CanonicalizationError) as info:
        canonicalize({"attn": view}, [KVCacheGroup(["attn"], spec)], 3)
    message = str(info.value)
    for part in ("'attn'", "(3, 2, 32, 32)", "torch.bfloat16", "FullAttentionSpec", "dense"):
        assert part in message


def test_page_size_mismatch_is_refused():
    spec = FullAttentionSpec(**ATTN)
    cache = torch.zeros(3, 2, 32, 16, dtype=torch.bfloat16)  # K only: half the page
    with pytest.raises(CanonicalizationError, match="the spec says"):
        canonicalize({"attn": cache}, [KVCacheGroup(["attn"], spec)], 3)


def test_missing_layer_is_named():
    spec = FullAttentionSpec(**ATTN)
    with pytest.raises(CanonicalizationError, match="'ghost' of cache group 0 is missing"):
        canonicalize({}, [KVCacheGroup(["ghost"], spec)], 3)


def test_pages_running_past_the_allocation_are_refused():
    spec = MambaSpec(block_size=32, shapes=((8,),), dtypes=(torch.float32,), page_size_padded=64)
    buffer = torch.zeros(3 * 64 - 20, dtype=torch.int8)  # the last padded page is cut short
    view = buffer.as_strided((3, 1, 1, 32), (64, 32, 32, 1))
    with pytest.raises(CanonicalizationError, match="end at byte"):
        canonicalize({"m": view}, [KVCacheGroup(["m"], spec)], 3)


def test_layers_overlapping_at_different_strides_are_refused():
    spec = FullAttentionSpec(**ATTN)
    page = spec.page_size_bytes
    buffer = torch.zeros(4 * page, dtype=torch.int8)
    a = buffer.as_strided((3, 2, 32, 64), (page, 2048, 64, 1), 0).view(torch.bfloat16)
    b = buffer.as_strided((3, 2, 32, 64), (page + 64, 2048, 64, 1), 64)
    with pytest.raises(CanonicalizationError, match="share bytes in different blocks"):
        canonicalize({"a": a, "b": b.view(torch.bfloat16)},
                     [KVCacheGroup(["a", "b"], spec)], 3)


def test_a_list_for_an_attention_layer_is_refused():
    spec = FullAttentionSpec(**ATTN)
    with pytest.raises(CanonicalizationError, match="got a list"):
        canonicalize({"a": [torch.zeros(3, 2)]}, [KVCacheGroup(["a"], spec)], 3)


def test_num_blocks_must_be_positive():
    with pytest.raises(CanonicalizationError, match="num_blocks"):
        canonicalize({}, [], 0)


def test_canonical_views_are_views_not_copies():
    model = build_example("llama-8b", 2)
    canonical = canonicalize(model.kv_caches, model.groups, 2)
    for t in canonical.tensors:
        assert t.tensor.untyped_storage().data_ptr() == model.buffer.data_ptr()


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_small_hybrid_fully_checked(layout):
    # Qwen3-Next in miniature: 3 Mamba layers per attention layer, pages unified.
    attn = FullAttentionSpec(**{**ATTN, "block_size": 64})
    mamba = MambaSpec(block_size=64, shapes=((3, 24), (2, 8, 8)),
                      dtypes=(torch.bfloat16, torch.float32), page_size_padded=attn.page_size_bytes)
    specs = {f"l{i}": attn if i % 4 == 3 else mamba for i in range(8)}
    groups = group_layers(specs)
    assert [len(g.layer_names) for g in groups] == [2, 2, 2, 2]
    _, caches = allocate_kv_caches(groups, 3, layout, [32 if g.spec is attn else None
                                                       for g in groups])
    canonical = check(caches, groups, 3)
    assert len(canonical.tensors) == 2
