"""OffloadScheduler (the connector's scheduler side): hits, load plans, request ends and
report lag, driven with vLLM's real Request and SchedulerOutput objects; no engine."""

from __future__ import annotations

import gc
import os

import pytest

pytest.importorskip("vllm")

from helpers.vllm_scheduler_helpers import (  # noqa: E402
    ABSENT,
    ATTN,
    BLOCK,
    IN_HOST,
    ON_DISK,
    NewRequestData,
    full_attention,
    hashes_of,
    keys,
    mixed_block_sizes,
    output,
    rank_meta,
    report,
    request_factory,
    run_hit,
    scheduler_for,
    stored,
    vkv,
)


@pytest.fixture
def make_request():
    return request_factory()


# --- (1), (2): readiness and the all-ranks rule ---

def test_no_answer_until_every_rank_reported(make_request):
    sched = full_attention(world_size=2)
    request = make_request("r", 100)
    assert sched.num_new_matched_tokens(request, 0)[:2] == (None, False)
    report(sched, 0, keys(request, range(3)))
    assert sched.num_new_matched_tokens(request, 0)[:2] == (None, False)
    report(sched, 1)  # an empty report still counts: rank 1 has sent its inventory
    assert sched.ready
    tokens, load_async, lookup = sched.num_new_matched_tokens(request, 0)
    assert (tokens, load_async) == (0, False)  # rank 1 holds nothing
    assert lookup.query_tokens == 100 and lookup.hit_tokens == 0


def test_aggregated_reports_of_both_ranks_make_it_ready(make_request):
    sched = full_attention(world_size=2)
    request = make_request("r", 100)
    both = rank_meta(0, keys(request, range(3)), IN_HOST)
    both = both.aggregate(rank_meta(1, keys(request, range(2)), ON_DISK))
    sched.apply_worker_meta(both)
    assert sched.num_new_matched_tokens(request, 0)[:2] == (64, True)


def test_a_hit_needs_the_key_on_every_rank(make_request):
    sched = full_attention(world_size=2)
    request = make_request("r", 100)
    report(sched, 0, keys(request, range(3)))
    report(sched, 1)
    assert sched.num_new_matched_tokens(request, 0)[:2] == (0, False)
    report(sched, 1, keys(request, range(2)))
    assert sched.num_new_matched_tokens(request, 0)[:2] == (64, True)
    report(sched, 1, keys(request, [1]), old=IN_HOST, new=ABSENT)  # rank 1 evicted block 1
    assert sched.num_new_matched_tokens(request, 0)[:2] == (32, True)
    report(sched, 0, keys(request, [0]), old=IN_HOST, new=ABSENT)
    assert sched.num_new_matched_tokens(request, 0)[:2] == (0, False)


# --- (3): hit length ---

@pytest.mark.parametrize("num_tokens", [31, 32, 33, 100, 128, 129])
def test_full_attention_hit_never_covers_the_last_token(make_request, num_tokens):
    sched = full_attention()
    request = make_request("r", num_tokens)
    report(sched, 0, keys(request, range(len(request.block_hashes))))
    tokens, load_async, _ = sched.num_new_matched_tokens(request, 0)
    expected = (num_tokens - 1) // BLOCK * BLOCK  # vLLM: at most num_tokens - 1, whole blocks
    assert tokens == expected
    assert load_async is (expected > 0)


def test_hit_is_the_cached_prefix_beyond_the_local_hit(make_request):
    sched = full_attention()
    request = make_request("r", 200)  # 6 hashes
    report(sched, 0, keys(request, [0, 1, 2, 3, 5]))  # block 4 missing: prefix is 4 blocks
    assert sched.num_new_matched_tokens(request, 0)[:2] == (128, True)
    assert sched.num_new_matched_tokens(request, 64)[:2] == (64, True)
    assert sched.num_new_matched_tokens(request, 128)[:2] == (0, False)
    assert sched.num_new_matched_tokens(request, 160)[:2] == (0, False)


def test_a_hit_is_not_bounded_by_the_host_tier_size(make_request):
    """Loads larger than a host tier are staged through it in batches, so a long disk
    hit is offered whole, whatever the ranks' host tiers hold."""
    sched = full_attention(world_size=2)
    request = make_request("r", 300)  # 9 full blocks
    for rank in (0, 1):
        report(sched, rank, keys(request, range(9)), new=ON_DISK)
    assert sched.num_new_matched_tokens(request, 0)[:2] == (9 * BLOCK, True)
    assert sched.num_new_matched_tokens(request, 2 * BLOCK)[:2] == (7 * BLOCK, True)


def test_a_rank_reset_forgets_only_that_ranks_keys(make_request):
    sched = full_attention(world_size=2)
    request = make_request("r", 100)
    for rank in (0, 1):
        report(sched, rank, keys(request, range(3)))
    report(sched, 1, keys(request, [0]), reset=True)  # rank 1 was reset, then stored block 0
    assert sched.num_new_matched_tokens(request, 0)[:2] == (32, True)


def test_a_different_prompt_does_not_hit(make_request):
    sched = full_attention()
    request = make_request("r", 100)
    report(sched, 0, keys(request, range(3)))
    other = make_request("o", 100, first_token=2)  # different tokens, different chained hashes
    assert sched.num_new_matched_tokens(other, 0)[:2] == (0, False)


# --- (4): load plan over full attention + sliding window ---

def test_load_plan_full_attention_and_sliding_window(make_request):
    # Gemma3 order: group 0 sliding window (64 tokens), group 1 full attention.
    sched = scheduler_for(vkv.SlidingWindowSpec(sliding_window=64, **ATTN),
                          vkv.FullAttentionSpec(**ATTN))
    request = make_request("r", 8 * BLOCK + 4)  # 8 full blocks
    report(sched, 0, keys(request, range(8), group=1))
    report(sched, 0, keys(request, range(4, 8), group=0))  # only recent SWA blocks were kept
    tokens, load_async, _ = sched.num_new_matched_tokens(request, 2 * BLOCK)
    assert (tokens, load_async) == (6 * BLOCK, True)
    # vLLM allocates the null block (0) for sliding-window blocks outside the window.
    swa_ids = [0, 0, 0, 0, 0, 0, 27, 28, 29]
    full_ids = list(range(10, 19))
    sched.after_alloc(request, (swa_ids, full_ids), tokens)
    assert sched.source_of("r") is IN_HOST
    meta = sched.build_meta(output())
    plan = meta.loads["r"]
    assert plan[1] == (hashes_of(request, range(2, 8)), full_ids[2:8])
    assert plan[0] == (hashes_of(request, [6, 7]), [27, 28])  # the window before the hit
    assert all(0 not in ids for _, ids in plan.values())
    assert meta.stores == {}
    assert sched.build_meta(output()).loads == {}  # a plan is sent once


def test_sliding_window_gap_before_the_hit_point_shortens_the_hit(make_request):
    sched = scheduler_for(vkv.SlidingWindowSpec(sliding_window=64, **ATTN),
                          vkv.FullAttentionSpec(**ATTN))
    request = make_request("r", 8 * BLOCK + 4)
    report(sched, 0, keys(request, range(8), group=1))
    report(sched, 0, keys(request, [4, 5, 7], group=0))  # block 6 of the window is missing
    # Windows ending at 8 and at 7 blocks both need block 6; the one ending at 6 is cached.
    assert sched.num_new_matched_tokens(request, 0)[:2] == (6 * BLOCK, True)


def test_no_load_when_vllm_allocates_no_external_tokens(make_request):
    sched = full_attention()
    request = make_request("r", 100)
    report(sched, 0, keys(request, range(3)))
    assert sched.num_new_matched_tokens(request, 0)[:2] == (96, True)
    sched.after_alloc(request, ([1, 2, 3, 4],), 0)
    assert sched.build_meta(output()).loads == {}
    assert sched.num_new_matched_tokens(request, 0)[:2] == (96, True)  # not marked loading


# --- what the tiers are asked to keep ---

def test_a_lookup_protects_exactly_the_blocks_its_hit_needs_deepest_first(make_request):
    """The full-attention prefix and the sliding-window blocks right before the hit point,
    never the sliding-window blocks no hit needs; the first block of the prefix last (most
    recent); once per request, also when vLLM's own cache holds those tokens."""
    sched = scheduler_for(vkv.SlidingWindowSpec(sliding_window=64, **ATTN),
                          vkv.FullAttentionSpec(**ATTN))
    request = make_request("r", 8 * BLOCK + 4)
    report(sched, 0, keys(request, range(8), group=1))
    report(sched, 0, keys(request, range(8), group=0))  # every sliding-window block held
    assert sched.num_new_matched_tokens(request, 8 * BLOCK)[:2] == (0, False)  # vLLM's hit
    assert sched.num_new_matched_tokens(request, 8 * BLOCK)[:2] == (0, False)  # asked again
    protect = sched.build_meta(output()).protect
    want = [*keys(request, [7], group=1), *keys(request, [7], group=0),
            *keys(request, [6], group=1), *keys(request, [6], group=0),
            *keys(request, range(5, -1, -1), group=1)]
    assert protect == want
    assert sched.build_meta(output()).protect == []  # sent once


def test_a_prefix_another_request_asked_for_is_protected_before_it_is_stored(make_request):
    """Two requests on one document arrive together: nothing is held yet, but the second
    lookup protects the servable unit at their shared prefix (full attention up to it,
    the window before it), so the first request's store lands protected."""
    sched = scheduler_for(vkv.SlidingWindowSpec(sliding_window=64, **ATTN),
                          vkv.FullAttentionSpec(**ATTN))
    report(sched, 0)
    first = make_request("a", 5 * BLOCK + 4)
    second = make_request("b", 5 * BLOCK + 20)  # the same 5 blocks, another tail
    assert sched.num_new_matched_tokens(first, 0)[:2] == (0, False)
    assert sched.build_meta(output()).protect == []  # asked once: nothing to keep yet
    assert sched.num_new_matched_tokens(second, 0)[:2] == (0, False)
    protect = sched.build_meta(output()).protect
    assert protect == [*keys(second, [4], group=1), *keys(second, [4], group=0),
                       *keys(second, [3], group=1), *keys(second, [3], group=0),
                       *keys(second, [2, 1, 0], group=1)]


def test_a_lookup_without_a_hit_protects_nothing(make_request):
    sched = full_attention()
    request = make_request("r", 100)
    report(sched, 0, keys(request, [1, 2]))  # block 0 missing: no prefix
    assert sched.num_new_matched_tokens(request, 0)[:2] == (0, False)
    assert sched.build_meta(output()).protect == []


# --- (6), (7): load failures and request ends ---

def hit_and_load(sched, request, block_ids):
    tokens, load_async = run_hit(sched, request, block_ids)
    assert load_async and tokens > 0
    return sched.build_meta(output()).loads[request.request_id]


def test_a_failed_load_turns_later_lookups_into_misses(make_request):
    sched = full_attention()
    request = make_request("r", 100)
    report(sched, 0, keys(request, range(3)))
    hit_and_load(sched, request, ([1, 2, 3, 4],))
    assert sched.num_new_matched_tokens(request, 0)[:2] == (0, False)  # while loading
    sched.loads_finished({"r"}, {"r"})
    assert sched.num_new_matched_tokens(request, 0)[:2] == (0, False)
    other = make_request("s", 100)  # same prompt, another request: still a hit
    assert sched.num_new_matched_tokens(other, 0)[:2] == (96, True)


def test_after_a_successful_load_the_loaded_prefix_is_local(make_request):
    sched = full_attention()
    request = make_request("r", 100)
    report(sched, 0, keys(request, range(3)))
    hit_and_load(sched, request, ([1, 2, 3, 4],))
    sched.loads_finished({"r"}, set())
    assert sched.num_new_matched_tokens(request, 96)[:2] == (0, False)


def test_finishing_while_loading_keeps_the_blocks_until_the_load_reports(make_request):
    sched = full_attention()
    request = make_request("r", 100)
    report(sched, 0, keys(request, range(3)))
    hit_and_load(sched, request, ([1, 2, 3, 4],))
    assert sched.request_finished("r") is True
    sched.loads_finished({"r"}, {"r"})
    # The state was dropped with the report: a request reusing the id starts afresh
    # (had the failed state survived, this lookup would be a miss).
    reused = make_request("r", 100)
    assert sched.num_new_matched_tokens(reused, 0)[:2] == (96, True)


def test_finishing_without_a_load_frees_at_once(make_request):
    sched = full_attention()
    request = make_request("r", 100)
    report(sched, 0, keys(request, range(3)))
    assert sched.num_new_matched_tokens(request, 0)[:2] == (96, True)
    assert sched.request_finished("r") is False  # hit found, never allocated
    sched.after_alloc(request, ([1, 2, 3, 4],), 96)  # a late allocation plans nothing
    assert sched.build_meta(output()).loads == {}
    assert sched.request_finished("never-seen") is False


def test_finishing_after_the_load_reported_frees_at_once(make_request):
    sched = full_attention()
    request = make_request("r", 100)
    report(sched, 0, keys(request, range(3)))
    hit_and_load(sched, request, ([1, 2, 3, 4],))
    sched.loads_finished({"r"}, set())
    assert sched.request_finished("r") is False


def test_reset_is_sent_once():
    sched = full_attention()
    sched.reset()
    assert sched.build_meta(output()).reset is True
    assert sched.build_meta(output()).reset is False


# --- (8): where a hit is read from ---

def test_source_is_host_only_when_every_rank_has_every_block_in_memory(make_request):
    sched = full_attention(world_size=2)
    request = make_request("r", 100)
    for rank in (0, 1):
        report(sched, rank, keys(request, range(3)))
    run_hit(sched, request, ([1, 2, 3, 4],))
    assert sched.source_of("r") is IN_HOST
    report(sched, 1, keys(request, [1]), old=IN_HOST, new=ON_DISK)  # rank 1 evicted to disk
    assert sched.source_of("r") is ON_DISK
    assert sched.num_new_matched_tokens(make_request("s", 100), 0)[:2] == (96, True)
    report(sched, 1, keys(request, [1]), old=ON_DISK, new=IN_HOST)  # read back into memory
    assert sched.source_of("r") is IN_HOST


def test_source_is_disk_for_a_hit_only_on_disk(make_request):
    sched = full_attention()
    request = make_request("r", 100)
    report(sched, 0, keys(request, range(3)), new=ON_DISK)
    assert sched.num_new_matched_tokens(request, 0)[:2] == (96, True)
    sched.after_alloc(request, ([1, 2, 3, 4],), 96)
    assert sched.source_of("r") is ON_DISK


def test_a_larger_block_is_keyed_by_the_hash_at_its_end(make_request):
    sched = mixed_block_sizes()
    request = make_request("r", 4 * BLOCK + 1)  # 4 hashes = 2 blocks of the full group
    report(sched, 0, keys(request, range(4), group=0))
    report(sched, 0, [(bytes(request.block_hashes[1]), 1), (bytes(request.block_hashes[3]), 1)])
    tokens, load_async = run_hit(sched, request, ([21, 22, 23, 24], [30, 31]))
    assert (tokens, load_async) == (4 * BLOCK, True)
    plan = sched.build_meta(output()).loads["r"]
    assert plan[1] == (hashes_of(request, [1, 3]), [30, 31])
    assert plan[0] == (hashes_of(request, [2, 3]), [23, 24])
    # Without the hash at the end of full block 1, only the first 64 tokens hit.
    report(sched, 0, [(bytes(request.block_hashes[3]), 1)], old=IN_HOST, new=ABSENT)
    assert sched.num_new_matched_tokens(make_request("s", 4 * BLOCK + 1), 0)[:2] == (64, True)


# --- reports lag plans by a step ---

def test_a_prefix_whose_store_is_planned_hits_before_the_ranks_report_it(make_request):
    """The prefix a request stored is reported a step later or more: a new request with
    that prefix hits at once on the stores this side planned (the workers' loads wait for
    those stores), and once the reports reflect that step only what the ranks hold counts:
    a store that did not land on a rank is a miss again."""
    sched = full_attention(world_size=2)
    for rank in (0, 1):
        report(sched, rank, reflected_step=-1)
    first = make_request("a", 100)
    sched.num_new_matched_tokens(first, 0)
    new = NewRequestData.from_request(first, ([1, 2, 3, 4],))
    meta = sched.build_meta(output(new=[new], scheduled={"a": 100}))
    assert len(stored(meta)) == 3
    again = make_request("b", 100)
    other = make_request("c", 100, first_token=500)
    assert sched.num_new_matched_tokens(again, 0)[:2] == (96, True)  # no wait, no miss
    assert sched.num_new_matched_tokens(other, 0)[:2] == (0, False)  # unrelated: a miss
    sched.after_alloc(again, ([5, 6, 7, 8],), 96)
    assert sched.source_of("b") is IN_HOST  # (a store lands in host memory)
    assert sched.build_meta(output()).loads["b"] == {0: (hashes_of(first, range(3)),
                                                         [5, 6, 7])}
    done = keys(first, range(3))
    report(sched, 0, done, reflected_step=meta.step)
    assert sched.num_new_matched_tokens(make_request("d", 100), 0)[:2] == (96, True)
    report(sched, 1, keys(first, range(2)), reflected_step=meta.step)  # block 2 failed here
    assert sched.num_new_matched_tokens(make_request("e", 100), 0)[:2] == (64, True)


def test_lookup_waits_until_a_reset_is_reported(make_request):
    sched = full_attention()
    request = make_request("r", 100)
    report(sched, 0, keys(request, range(3)))
    sched.reset()
    assert sched.num_new_matched_tokens(request, 0)[:2] == (None, False)
    meta = sched.build_meta(output())
    assert meta.reset
    report(sched, 0, reflected_step=meta.step - 1)
    assert sched.num_new_matched_tokens(request, 0)[:2] == (None, False)
    report(sched, 0, reset=True, reflected_step=meta.step)
    assert sched.num_new_matched_tokens(request, 0)[:2] == (0, False)


def test_a_request_asked_again_is_counted_in_the_stats_once(make_request):
    """vLLM asks again about a request it could not schedule yet: one lookup in the stats."""
    sched = full_attention()
    report(sched, 0)
    request = make_request("r", 100)
    first = sched.num_new_matched_tokens(request, 0)[2]
    assert first is not None and first.query_tokens == 100
    assert sched.num_new_matched_tokens(request, 0)[2] is None


def test_a_full_collection_skips_the_keys_ranks_reported(make_request):
    # With a million keys reported, containers the collector tracks would cost every full
    # collection ~50 ms (walked entry by entry); the per-group maps are untracked, and
    # stay so as new keys (newly made, tracked tuples) keep arriving.
    sched = full_attention(world_size=2)
    for rank in (0, 1):
        report(sched, rank, [(os.urandom(32), 0) for _ in range(1000)])
    gc.collect()
    fresh = [(os.urandom(32), 0)]
    report(sched, 0, fresh, new=ON_DISK)
    report(sched, 1, fresh)
    assert sched._keys.held_by_all(fresh[0])
    assert not any(gc.is_tracked(hashes) for rank in sched._keys._ranks.values()
                   for hashes in rank.values())
