"""blocks_worth_storing: exactly the blocks some aligned hit point would load."""

from __future__ import annotations

import pytest
from hit_reference import chunked, cross, full, group_specs, mamba, needed_blocks, swa
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_offload.errors import HitLookupError
from kv_offload.hits import StoreFrontier, blocks_worth_storing


def reference(spec, num_blocks: int, align: int) -> list[int]:
    step = align // spec.block_size
    union: set[int] = set()
    for n in range(step, num_blocks + 1, step):
        union |= set(needed_blocks(spec, n) or [])
    return sorted(union)


@settings(max_examples=300, deadline=None)
@given(group_specs(), st.integers(0, 80), st.integers(1, 6))
def test_is_the_union_of_the_blocks_every_hit_point_loads(spec, num_blocks, factor):
    align = spec.block_size * factor
    got = blocks_worth_storing(spec, num_blocks, alignment_tokens=align)
    assert got == reference(spec, num_blocks, align)


@settings(max_examples=400, deadline=None)
@given(group_specs(), st.lists(st.integers(0, 40), max_size=8), st.integers(1, 6))
def test_a_frontier_advanced_step_by_step_decides_exactly_the_union_each_block_once(
        spec, increments, factor):
    align = spec.block_size * factor
    frontier = StoreFrontier(spec, alignment_tokens=align)
    decided: list[int] = []
    num_blocks = 0
    for increment in [0, *increments]:
        num_blocks += increment
        new = frontier.advance(num_blocks)
        assert new == sorted(new)
        decided += new
        assert sorted(decided) == reference(spec, num_blocks, align)
    assert len(decided) == len(set(decided))


def test_full_attention_stores_everything_cross_attention_nothing():
    assert blocks_worth_storing(full(16), 5) == [0, 1, 2, 3, 4]
    assert blocks_worth_storing(cross(16), 5) == []


def test_sliding_window_with_a_coarse_alignment_skips_blocks_far_from_every_hit_point():
    # Hits end on multiples of 8 blocks (e.g. a Mamba group of 8x the block size);
    # a window of 2 blocks only needs the 2 blocks before each of them.
    spec = swa(16, 32)  # ceil(31 / 16) = 2 blocks
    assert blocks_worth_storing(spec, 20, alignment_tokens=128) == [6, 7, 14, 15]
    # with the group's own alignment every block ends some hit point
    assert blocks_worth_storing(spec, 5) == [0, 1, 2, 3, 4]


def test_mamba_stores_the_state_at_each_hit_point_only():
    assert blocks_worth_storing(mamba(16), 10, alignment_tokens=64) == [3, 7]
    assert blocks_worth_storing(mamba(16), 3) == [0, 1, 2]


def test_chunked_local_stores_the_blocks_inside_chunks_before_each_hit_point():
    # chunks of 4 blocks, hits every 2 blocks: a hit at 2 or 6 blocks needs the
    # first half of its chunk; hits at 4 and 8 start a fresh chunk.
    assert blocks_worth_storing(chunked(8, 32), 8, alignment_tokens=16) == [0, 1, 4, 5]


def test_bad_arguments_are_typed_errors():
    with pytest.raises(HitLookupError, match="alignment_tokens"):
        blocks_worth_storing(full(16), 4, alignment_tokens=24)
    with pytest.raises(HitLookupError, match="num_blocks"):
        blocks_worth_storing(full(16), -1)
