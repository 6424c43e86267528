"""`HeldBlocks`, the lookup's `is_cached`: the same answers as asking every rank's map key
by key, and a lookup that misses early reads one chunk of the prompt, not all of it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from kv_offload.types import HOST_BIT  # noqa: E402
from kv_offload.vllm.rank_keys import HeldBlocks, RankKeys  # noqa: E402

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


def test_a_lookup_that_misses_at_block_0_reads_one_chunk_of_a_long_prompt():
    class Counting(RankKeys):
        asked = 0

        def held_by_all_of(self, group, block_hashes):
            Counting.asked += len(block_hashes)
            return super().held_by_all_of(group, block_hashes)

    keys = Counting(1)
    keys.apply(0, [], b"")
    is_cached = HeldBlocks(keys, [HASHES])
    assert is_cached(0, 0) is False
    assert Counting.asked == HeldBlocks.CHUNK < len(HASHES)
