"""`HeldBlocks`, the lookup's `is_cached`: the same answers as asking every rank's map key
by key, and a lookup that misses early reads one chunk of the prompt, not all of it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from kv_offload.types import HOST_BIT  # noqa: E402
from kv_offload.vllm.scheduler.rank_keys import HeldBlocks, RankKeys  # noqa: E402

HASHES = [i.to_bytes(8, "little") for i in range(600)]  # > 2 chunks


def keys_with(held_by_rank: list[set[int]]) -> RankKeys:
    keys = RankKeys(len(held_by_rank))
    for rank, held in enumerate(held_by_rank):
        chosen = [(HASHES[i], 0) for i in sorted(held)]
        keys.apply(rank, chosen, bytes([HOST_BIT] * len(chosen)))
    return keys


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sets(st.integers(0, len(HASHES) - 1), max_size=300), min_size=1,
                max_size=3),
       st.lists(st.integers(0, len(HASHES) + 5), max_size=30))
def test_every_answer_is_whether_every_rank_holds_that_blocks_key(held_by_rank, asked):
    is_cached = HeldBlocks(keys_with(held_by_rank), [HASHES])
    for block in asked:  # any order, past the end too
        expected = block < len(HASHES) and all(block in held for held in held_by_rank)
        assert is_cached(0, block) is expected


def test_a_lookup_that_misses_at_block_0_reads_the_first_small_chunk_of_a_long_prompt():
    class Counting(RankKeys):
        asked = 0

        def held_by_all_of(self, group, block_hashes):
            Counting.asked += len(block_hashes)
            return super().held_by_all_of(group, block_hashes)

    keys = Counting(1)
    keys.apply(0, [], b"")
    is_cached = HeldBlocks(keys, [HASHES])
    assert is_cached(0, 0) is False
    assert Counting.asked == HeldBlocks.FIRST_CHUNK < len(HASHES)
    learned = []  # asking each first unknown block in turn: chunks double up to CHUNK
    while Counting.asked < len(HASHES):
        assert is_cached(0, Counting.asked) is False
        learned.append(Counting.asked)
    assert learned == [32, 64, 128, 256, 512, 600]


ALL = frozenset(range(len(HASHES)))
HELD = st.one_of(st.sets(st.integers(0, len(HASHES) - 1), max_size=300),  # sparse, or
                 st.sets(st.integers(0, len(HASHES) - 1), min_size=1, max_size=2).map(
                     ALL.difference))  # (long runs: across chunks)


@settings(max_examples=100, deadline=None)
@given(st.lists(HELD, min_size=1, max_size=3),
       st.lists(st.tuples(st.integers(0, len(HASHES) + 5), st.integers(0, len(HASHES) + 5),
                          st.booleans()), max_size=20))
@example([ALL - {300}], [(10, len(HASHES), False)])  # a run that crosses a chunk
def test_a_run_counts_the_blocks_every_rank_holds_up_to_the_first_that_one_does_not(
        held_by_rank, asked):
    is_cached = HeldBlocks(keys_with(held_by_rank), [HASHES])
    for start, stop, single in asked:  # runs and single answers interleaved, any order
        if single:
            assert is_cached(0, start) is (
                start < len(HASHES) and all(start in held for held in held_by_rank))
            continue
        expected = 0
        while start + expected < min(stop, len(HASHES)) and all(
                start + expected in held for held in held_by_rank):
            expected += 1
        assert is_cached.run(0, start, stop) == expected


def test_a_full_attention_hit_of_many_blocks_is_found_without_asking_block_by_block():
    from kv_offload import find_longest_cache_hit
    from kv_offload.specs import FullAttentionSpec

    class Counting(HeldBlocks):
        singles = 0

        def _held(self, group, block):
            Counting.singles += 1
            return super()._held(group, block)

    held = set(range(len(HASHES))) - {530}
    is_cached = Counting(keys_with([held, held]), [HASHES])
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)
    hit = find_longest_cache_hit([spec], is_cached, len(HASHES) * 16)
    assert hit.num_tokens == 530 * 16
    assert Counting.singles == 0
