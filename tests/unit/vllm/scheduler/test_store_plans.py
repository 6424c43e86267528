"""OffloadScheduler store plans, driven with vLLM's real Request and SchedulerOutput
objects; no engine is started."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from helpers.vllm_scheduler_helpers import (  # noqa: E402
    ATTN,
    BLOCK,
    ON_DISK,
    NewRequestData,
    cached_step,
    full_attention,
    hashes_of,
    keys,
    mixed_block_sizes,
    output,
    report,
    request_factory,
    scheduler_for,
    stored,
    vkv,
)


@pytest.fixture
def make_request():
    return request_factory()


# --- (5): store plans ---

def test_stores_blocks_completed_by_each_step_once(make_request):
    sched = full_attention()
    request = make_request("r", 100)  # 3 full blocks + 4 tokens
    report(sched, 0)
    assert sched.num_new_matched_tokens(request, 0)[:2] == (0, False)
    sched.after_alloc(request, ([1, 2, 3, 4],), 0)
    new = NewRequestData.from_request(request, ([1, 2],))
    meta = sched.build_meta(output(new=[new], scheduled={"r": 40}))  # chunked prefill
    assert stored(meta) == list(zip(hashes_of(request, [0]), [1]))
    request.num_computed_tokens = 40  # vLLM's _update_after_schedule
    meta = sched.build_meta(output(cached=cached_step(request, ([3, 4],)),
                                   scheduled={"r": 60}))
    assert stored(meta) == list(zip(hashes_of(request, [1, 2]), [2, 3]))  # appended ids
    request.num_computed_tokens = 100
    meta = sched.build_meta(output(cached=cached_step(request, None), scheduled={"r": 1}))
    assert meta.stores == {}  # nothing new completed, nothing stored twice


def test_decode_tokens_complete_blocks_as_their_hashes_arrive(make_request):
    sched = full_attention()
    request = make_request("r", 62)
    sched.num_new_matched_tokens(request, 0)
    meta = sched.build_meta(output(new=[NewRequestData.from_request(request, ([5, 6],))],
                                   scheduled={"r": 62}))
    assert stored(meta) == list(zip(hashes_of(request, [0]), [5]))
    request.num_computed_tokens = 62
    request.append_output_token_ids([900, 901])  # 64 tokens: vLLM hashes block 1
    assert len(request.block_hashes) == 2
    meta = sched.build_meta(output(cached=cached_step(request, None), scheduled={"r": 1}))
    assert meta.stores == {}  # token 63 is not computed yet
    request.num_computed_tokens = 63
    meta = sched.build_meta(output(cached=cached_step(request, None), scheduled={"r": 1}))
    assert stored(meta) == list(zip(hashes_of(request, [1]), [6]))


def test_speculative_tokens_are_not_counted_as_computed(make_request):
    sched = full_attention()
    request = make_request("r", 64)
    sched.num_new_matched_tokens(request, 0)
    new = NewRequestData.from_request(request, ([5, 6, 7],))
    meta = sched.build_meta(output(new=[new], scheduled={"r": 33}))
    assert stored(meta) == list(zip(hashes_of(request, [0]), [5]))
    request.num_computed_tokens = 33
    # 31 scheduled tokens of which 2 are draft tokens: block 1 is not complete yet.
    meta = sched.build_meta(output(cached=cached_step(request, None), scheduled={"r": 31},
                                   spec_tokens={"r": [7, 8]}))
    assert meta.stores == {}
    request.num_computed_tokens = 62
    meta = sched.build_meta(output(cached=cached_step(request, None), scheduled={"r": 3},
                                   spec_tokens={"r": [7]}))
    assert stored(meta) == list(zip(hashes_of(request, [1]), [6]))


def test_keys_held_by_every_rank_are_not_stored_again(make_request):
    sched = full_attention(world_size=2)
    request = make_request("r", 100)
    report(sched, 0, keys(request, [0, 1]))
    report(sched, 1, keys(request, [0]), new=ON_DISK)
    sched.num_new_matched_tokens(request, 0)  # hit of block 0 only: take none of it
    sched.after_alloc(request, ([1, 2, 3, 4],), 0)
    new = NewRequestData.from_request(request, ([1, 2, 3, 4],))
    meta = sched.build_meta(output(new=[new], scheduled={"r": 100}))
    # Block 0 is on both ranks; block 1 only on rank 0 (rank 1 still needs it).
    assert stored(meta) == list(zip(hashes_of(request, [1, 2]), [2, 3]))


def test_resumed_request_block_ids_replace_the_old_ones(make_request):
    sched = full_attention()
    request = make_request("r", 100)
    sched.num_new_matched_tokens(request, 0)
    new = NewRequestData.from_request(request, ([1, 2],))
    assert len(stored(sched.build_meta(output(new=[new], scheduled={"r": 64})))) == 2
    # Preempted (blocks freed), then resumed with a fresh allocation and a local hit of 64.
    request.num_computed_tokens = 64
    meta = sched.build_meta(output(cached=cached_step(request, ([7, 8, 9, 10],), resumed=True),
                                   scheduled={"r": 36}))
    assert stored(meta) == list(zip(hashes_of(request, [2]), [9]))


def test_sliding_window_stores_skip_null_blocks(make_request):
    sched = scheduler_for(vkv.SlidingWindowSpec(sliding_window=64, **ATTN),
                          vkv.FullAttentionSpec(**ATTN))
    request = make_request("r", 4 * BLOCK + 1)
    sched.num_new_matched_tokens(request, 0)
    new = NewRequestData.from_request(request, ([0, 21, 22, 23, 24], [30, 31, 32, 33, 34]))
    meta = sched.build_meta(output(new=[new], scheduled={"r": 4 * BLOCK + 1}))
    assert stored(meta, 1) == list(zip(hashes_of(request, range(4)), [30, 31, 32, 33]))
    assert stored(meta, 0) == list(zip(hashes_of(request, [1, 2, 3]), [21, 22, 23]))


def test_unknown_and_finished_requests_plan_nothing(make_request):
    sched = full_attention()
    request = make_request("r", 100)
    new = NewRequestData.from_request(request, ([1, 2, 3, 4],))
    assert sched.build_meta(output(new=[new], scheduled={"r": 100})).stores == {}
    sched.num_new_matched_tokens(request, 0)
    assert sched.request_finished("r") is False
    assert sched.build_meta(output(new=[new], scheduled={"r": 100})).stores == {}


# --- groups whose block size is a multiple of the hash block size ---

def test_sliding_window_block_needed_by_a_later_hit_point_is_stored(make_request):
    sched = mixed_block_sizes()
    request = make_request("r", 4 * BLOCK + 1)
    report(sched, 0)
    sched.num_new_matched_tokens(request, 0)
    new = NewRequestData.from_request(request, ([1, 2, 3], [10, 11]))
    first = sched.build_meta(output(new=[new], scheduled={"r": 3 * BLOCK}))  # chunked prefill
    request.num_computed_tokens = 3 * BLOCK
    second = sched.build_meta(output(cached=cached_step(request, ([4], [])),
                                     scheduled={"r": BLOCK + 1}))
    swa_stored = stored(first, 0) + stored(second, 0)
    # The hit at 128 tokens needs the window before it: sliding-window blocks 2 and 3.
    assert swa_stored == list(zip(hashes_of(request, range(4)), [1, 2, 3, 4]))


def test_windows_far_from_every_hit_point_are_skipped_and_large_blocks_use_their_last_hash(
        make_request):
    # Hits end on multiples of 64 tokens (the full group's block), so a one-block window
    # (32 tokens) needs only the block before each hit point: blocks 1, 3, 5, 7 (not one
    # run); a 64-token block of the full group is named by the hash of its second half.
    sched = scheduler_for(vkv.SlidingWindowSpec(sliding_window=BLOCK, **ATTN),
                          vkv.FullAttentionSpec(**{**ATTN, "block_size": 2 * BLOCK}))
    request = make_request("r", 8 * BLOCK + 1)
    report(sched, 0)
    sched.num_new_matched_tokens(request, 0)
    new = NewRequestData.from_request(request, ([1, 2, 3, 4, 5], [11, 12, 13]))
    first = sched.build_meta(output(new=[new], scheduled={"r": 5 * BLOCK}))
    request.num_computed_tokens = 5 * BLOCK
    second = sched.build_meta(output(cached=cached_step(request, ([6, 7, 8, 9], [14, 15])),
                                     scheduled={"r": 3 * BLOCK + 1}))
    assert stored(first, 0) == list(zip(hashes_of(request, [1, 3]), [2, 4]))
    assert stored(second, 0) == list(zip(hashes_of(request, [5, 7]), [6, 8]))
    assert stored(first, 1) == list(zip(hashes_of(request, [1, 3]), [11, 12]))
    assert stored(second, 1) == list(zip(hashes_of(request, [5, 7]), [13, 14]))
