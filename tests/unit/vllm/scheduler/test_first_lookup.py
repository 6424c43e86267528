"""A fresh engine's first lookup, after the report wait ran out and before any worker
reported: a miss (recompute), never an exception."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from kv_offload.vllm.scheduler.offload_scheduler import MAX_REPORT_WAIT_S  # noqa: E402
from kv_offload.vllm.scheduler.rank_keys import HeldBlocks, RankKeys  # noqa: E402

from helpers.vllm_scheduler_helpers import full_attention, request_factory  # noqa: E402


def test_a_lookup_before_every_rank_reported_is_nothing_held():
    keys = RankKeys(world_size=2)
    is_cached = HeldBlocks(keys, [[b"a", b"b", b"c"]])
    assert [is_cached(0, block) for block in range(3)] == [False, False, False]


def test_a_first_lookup_after_the_report_wait_and_before_any_report_is_a_miss():
    sched = full_attention(world_size=2)
    sched._created = time.monotonic() - MAX_REPORT_WAIT_S - 1  # started > 5 s ago
    assert sched.ready
    request = request_factory()("r1", 4 * 16 + 3)
    tokens, load_async, lookup = sched.num_new_matched_tokens(request, 0)
    assert (tokens, load_async) == (0, False) and lookup.hit_tokens == 0
