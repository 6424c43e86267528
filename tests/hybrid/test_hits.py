"""find_longest_cache_hit over N groups, checked against a brute-force definition
(hit_reference.needed_blocks, written independently of the library's rules)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hit_reference import ATTN, chunked, cross, full, group_specs, mamba, needed_blocks, swa
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_offload import (
    CacheHit,
    FullAttentionSpec,
    KVCacheSpecRegistry,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    find_longest_cache_hit,
    register_kv_cache_spec,
)
from kv_offload.errors import HitLookupError, SpecError, UnregisteredSpecError
from kv_offload.layouts import attention_layout


def brute_force(specs, cached: list[set[int]], max_length: int) -> CacheHit:
    align = math.lcm(*(s.block_size for s in specs))
    for length in range(max_length // align * align, -1, -align):
        needs = [needed_blocks(s, length // s.block_size) for s in specs]
        if all(need is not None and set(need) <= cached[g] for g, need in enumerate(needs)):
            return CacheHit(length, needs)
    raise AssertionError("length 0 is always a hit")


class Oracle:
    """is_cached over explicit sets, recording every call."""

    def __init__(self, specs, cached: list[set[int]], max_length: int) -> None:
        self.specs, self.cached, self.max_length = specs, cached, max_length
        self.calls: list[tuple[int, int]] = []

    def __call__(self, g: int, i: int) -> bool:
        assert 0 <= g < len(self.specs), g
        assert 0 <= i < self.max_length // self.specs[g].block_size, (g, i)
        self.calls.append((g, i))
        return i in self.cached[g]


def check(specs, cached, max_length) -> CacheHit:
    oracle = Oracle(specs, cached, max_length)
    hit = find_longest_cache_hit(specs, oracle, max_length)
    expected = brute_force(specs, cached, max_length)
    assert hit.num_tokens == expected.num_tokens
    assert hit.blocks == expected.blocks
    assert len(oracle.calls) == len(set(oracle.calls)), "a block was queried twice"
    return hit


# --- hypothesis against brute force ---

@st.composite
def scenarios(draw):
    specs = draw(st.lists(group_specs(), min_size=1, max_size=5))
    max_length = draw(st.integers(0, 160))
    density = draw(st.sampled_from([0.5, 0.8, 0.95, 1.0]))
    cached = []
    for spec in specs:
        n = max_length // spec.block_size
        flags = draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))
        cached.append({i for i, f in enumerate(flags) if f < density})
    return specs, cached, max_length


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_matches_brute_force(scenario):
    check(*scenario)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=2, max_size=4), st.integers(0, 2**32 - 1),
       st.integers(0, 200))
def test_several_windows_with_holes_match_brute_force(windows, seed, max_length):
    """Sliding windows only (no downward-closed group), sparse holes: the search
    has to step down several times."""
    import random

    rng = random.Random(seed)
    specs = [swa(rng.choice([2, 4]), w) for w in windows]
    cached = [{i for i in range(max_length // s.block_size) if rng.random() < 0.85}
              for s in specs]
    check(specs, cached, max_length)


# --- named cases ---

def all_cached(specs, max_length):
    return [set(range(max_length // s.block_size)) for s in specs]


def test_more_than_two_groups_all_cached():
    specs = [full(4), swa(4, 9), mamba(8), chunked(4, 16)]
    hit = check(specs, all_cached(specs, 100), 100)
    assert hit.num_tokens == 96
    assert hit.blocks[0] == list(range(24))
    assert hit.blocks[1] == [22, 23]          # ceil(8 / 4) = 2 window blocks
    assert hit.blocks[2] == [11]              # the last state only
    assert hit.blocks[3] == []                # 96 starts a fresh chunk


def test_interleaved_group_ids_keep_their_own_cache_and_blocks():
    """Groups of the same type need not be adjacent; each keeps its index."""
    specs = [full(4), swa(4, 5), full(4), swa(4, 13)]
    cached = [set(range(20)), set(range(20)) - {17}, set(range(12)), set(range(20)) - {9}]
    hit = check(specs, cached, 80)
    # group 2 stops at 12 blocks; the 13-token window (3 blocks) of group 3 must
    # avoid block 9, so it ends at 9 blocks at most: 36 tokens.
    assert hit.num_tokens == 36
    assert hit.blocks[0] == list(range(9)) and hit.blocks[2] == list(range(9))
    assert hit.blocks[1] == [8]
    assert hit.blocks[3] == [6, 7, 8]


def test_several_different_sliding_windows():
    specs = [swa(2, 3), swa(2, 7), swa(2, 15)]   # windows of 1, 3 and 7 blocks
    cached = [set(range(30)), set(range(30)) - {19}, set(range(30)) - {21, 25}]
    hit = check(specs, cached, 60)
    # the 7-block window must avoid 21 and 25: it ends at 21 blocks at most; the
    # 3-block window then rejects 21 and 20 (block 19) and accepts 19.
    assert hit.num_tokens == 38
    assert hit.blocks == [[18], [16, 17, 18], list(range(12, 19))]


def test_no_full_attention_group_mamba_and_windows():
    specs = [swa(4, 17), mamba(4), swa(4, 5)]
    cached = [set(range(10)) - {6}, {3, 5, 8}, set(range(10))]
    hit = check(specs, cached, 40)
    # Mamba accepts 9, 6 or 4 blocks; the 4-block window rejects 9 (needs 5..8) and
    # accepts 6 (needs 2..5).
    assert hit.num_tokens == 24
    assert hit.blocks == [[2, 3, 4, 5], [5], [5]]


def test_mamba_sliding_window_and_full_together_with_different_block_sizes():
    specs = [full(2), swa(2, 5), mamba(6)]
    cached = [set(range(30)), set(range(30)) - {22, 28}, {1, 4, 7, 9}]
    hit = check(specs, cached, 60)
    # Mamba (6 tokens) accepts 60, 48, 30 or 12 tokens; the 2-block window rejects
    # 60 (block 28) and 48 (block 22) and accepts 30 (blocks 13, 14).
    assert hit.num_tokens == 30
    assert hit.blocks == [list(range(15)), [13, 14], [4]]


def test_blocks_are_exactly_the_window_and_the_last_state():
    specs = [full(16), swa(16, 1024), mamba(32)]
    hit = check(specs, all_cached(specs, 4096), 4096)
    assert hit.num_tokens == 4096
    assert hit.blocks[0] == list(range(256))
    assert hit.blocks[1] == list(range(256 - 64, 256))   # ceil(1023 / 16) = 64
    assert hit.blocks[2] == [127]


def test_window_of_one_token_needs_no_block_and_short_runs_from_zero_count():
    specs = [swa(4, 1), swa(4, 100)]
    cached = [set(), {0, 1, 2}]
    hit = check(specs, cached, 40)
    assert hit.num_tokens == 12            # a run from block 0 shorter than the window
    assert hit.blocks == [[], [0, 1, 2]]


def test_cross_attention_never_hits_and_max_length_zero():
    assert check([full(4), cross(4)], [set(range(10)), set(range(10))], 40).num_tokens == 0
    assert check([full(4)], [set(range(10))], 0) == CacheHit(0, [[]])


def test_result_is_a_multiple_of_every_block_size():
    specs = [full(4), full(6)]
    hit = check(specs, all_cached(specs, 50), 50)
    assert hit.num_tokens == 48 and hit.blocks == [list(range(12)), list(range(8))]


def test_uniform_type_group_uses_its_layers_rule():
    layers = {"a": swa(4, 9), "b": SlidingWindowSpec(block_size=4, sliding_window=9,
                                                     num_kv_heads=2, head_size=8,
                                                     dtype=torch.float16)}
    spec = UniformTypeKVCacheSpecs(block_size=4, kv_cache_specs=layers)
    hit = find_longest_cache_hit([spec], lambda g, i: i != 3, 40)
    assert hit == CacheHit(40, [[8, 9]])


def test_bad_input_is_a_typed_error():
    with pytest.raises(SpecError, match="at least one"):
        find_longest_cache_hit([], lambda g, i: True, 10)
    with pytest.raises(HitLookupError, match="max_length"):
        find_longest_cache_hit([full(4)], lambda g, i: True, -1)


# --- out-of-tree specs bring their own rule ---

class EvenEndHit:
    """Toy rule: a hit must end on an even block and its last two blocks be cached."""

    def longest_hit(self, spec, is_cached, max_blocks):
        for n in range(max_blocks - max_blocks % 2, 0, -2):
            if is_cached(n - 1) and is_cached(n - 2):
                return n
        return 0

    def blocks_to_load(self, spec, num_blocks):
        return range(max(0, num_blocks - 2), num_blocks)


@register_kv_cache_spec(hit_rule=EvenEndHit())
@dataclass(frozen=True, kw_only=True)
class EvenEndSpec(FullAttentionSpec):
    pass


def test_out_of_tree_spec_rule_is_honoured():
    specs = [full(4), EvenEndSpec(block_size=4, **ATTN)]
    cached = [set(range(10)), {0, 1, 2, 3, 4, 5, 7, 8}]
    # full accepts up to 10 blocks; EvenEnd: 10 needs 8, 9 (9 gone); 8 needs 6, 7 (6
    # gone); 6 needs 4, 5 -> 24 tokens, loading only blocks 4 and 5.
    hit = find_longest_cache_hit(specs, lambda g, i: i in cached[g], 40)
    assert hit == CacheHit(24, [list(range(6)), [4, 5]])


def test_registry_argument_is_used():
    registry = KVCacheSpecRegistry()
    with pytest.raises(UnregisteredSpecError):
        find_longest_cache_hit([full(4)], lambda g, i: True, 8, registry=registry)
    registry.register(FullAttentionSpec, layout=attention_layout, hit_rule=EvenEndHit())
    hit = find_longest_cache_hit([full(4)], lambda g, i: i != 1, 24, registry=registry)
    assert hit == CacheHit(24, [[4, 5]])


class OverreachingHit(EvenEndHit):
    def longest_hit(self, spec, is_cached, max_blocks):
        return max_blocks + 1


def test_rule_answering_out_of_range_is_reported():
    registry = KVCacheSpecRegistry()
    registry.register(FullAttentionSpec, layout=attention_layout, hit_rule=OverreachingHit())
    with pytest.raises(HitLookupError, match="OverreachingHit.*group 0"):
        find_longest_cache_hit([full(4)], lambda g, i: True, 8, registry=registry)
