"""When the next forward must wait for stores still copying out of engine memory
(`StoreFence`, `KVOffloadMetadata.wait_for_stores`), driven with vLLM's real Request and
SchedulerOutput objects; no engine.

The hazard: a store reads a block after the forward that completed it; vLLM may free that
block (finish, preemption, a sliding window moving on) and hand it to another request,
whose forward then writes it. The forward must wait exactly when a block allocated in its
step may still be read by a store not yet reported copied out."""

from __future__ import annotations

import random
from collections import deque

import pytest

pytest.importorskip("vllm")

from kv_offload.vllm.scheduler.store_fence import StoreFence  # noqa: E402

from helpers.vllm_scheduler_helpers import (  # noqa: E402
    ATTN,
    BLOCK,
    NewRequestData,
    cached_step,
    full_attention,
    output,
    report,
    request_factory,
    scheduler_for,
    stored,
    vkv,
)

BUSY = {"running elsewhere": 1}  # a step with a forward (a request we do not track)


@pytest.fixture
def make_request():
    return request_factory()


def _prefill(sched, request, block_ids):
    """Schedule a new request's whole prompt in one step; returns that step's metadata."""
    new = NewRequestData.from_request(request, (list(block_ids),))
    meta = sched.build_meta(output(new=[new], scheduled={request.request_id: request.num_tokens}))
    request.num_computed_tokens = request.num_tokens
    return meta


def _ready(sched):
    report(sched, 0, reflected_step=-1)
    return sched


def _admit(sched, request, block_ids):
    """A new request's lookup, then its whole prompt in one step: (request, metadata)."""
    sched.num_new_matched_tokens(request, 0)
    return request, _prefill(sched, request, block_ids)


def test_a_step_reusing_a_block_a_finished_requests_store_may_read_waits(make_request):
    sched = _ready(full_attention())
    first, meta = _admit(sched, make_request("a", 3 * BLOCK + 1), [1, 2, 3, 4])
    assert len(stored(meta)) == 3 and not meta.wait_for_stores
    sched.request_finished("a")  # vLLM frees blocks 1..4 at once
    _, meta = _admit(sched, make_request("b", 2 * BLOCK, first_token=900), [3, 9])
    assert meta.wait_for_stores  # block 3 may still be read


def test_a_freed_block_allocated_elsewhere_or_not_at_all_does_not_wait(make_request):
    sched = _ready(full_attention())
    first, _ = _admit(sched, make_request("a", 3 * BLOCK + 1), [1, 2, 3, 4])
    sched.request_finished("a")
    _, meta = _admit(sched, make_request("b", 2 * BLOCK, first_token=900), [7, 8])
    assert not meta.wait_for_stores
    assert not sched.build_meta(output(scheduled=BUSY)).wait_for_stores


def test_a_step_without_a_forward_settles_the_stores_in_flight(make_request):
    """(Its wait delays no forward, and the engine may go idle after it: its report and
    stats then show every store.)"""
    sched = _ready(full_attention())
    assert sched.build_meta(output()).wait_for_stores
    assert not sched.build_meta(output(scheduled=BUSY)).wait_for_stores


def test_once_the_store_is_reported_copied_out_its_blocks_are_free_to_reuse(make_request):
    sched = _ready(full_attention())
    first, meta = _admit(sched, make_request("a", 3 * BLOCK + 1), [1, 2, 3, 4])
    report(sched, 0, reflected_step=meta.step)  # every store of that step copied out
    sched.request_finished("a")
    _, meta = _admit(sched, make_request("b", 2 * BLOCK, first_token=900), [3, 9])
    assert not meta.wait_for_stores


def test_a_running_requests_full_attention_blocks_never_make_a_step_wait(make_request):
    sched = _ready(full_attention())
    first, _ = _admit(sched, make_request("a", 3 * BLOCK + 1), [1, 2, 3, 4])
    grow = sched.build_meta(output(cached=cached_step(first, ([5],)), scheduled={"a": 1}))
    assert not grow.wait_for_stores


def test_a_preempted_requests_stored_blocks_reallocated_in_that_step_wait(make_request):
    sched = _ready(full_attention())
    first, _ = _admit(sched, make_request("a", 3 * BLOCK + 1), [1, 2, 3, 4])
    taker = make_request("b", 2 * BLOCK, first_token=900)
    sched.num_new_matched_tokens(taker, 0)
    new = NewRequestData.from_request(taker, ([2, 1],))
    meta = sched.build_meta(output(new=[new], scheduled={"b": 2 * BLOCK}, preempted={"a"}))
    assert meta.wait_for_stores


def test_a_load_into_a_block_a_store_may_read_waits(make_request):
    """A hit's load writes blocks vLLM allocated for it in this step, before it runs."""
    sched = full_attention()
    cached = make_request("p", 3 * BLOCK + 1)  # a prompt our tier holds
    report(sched, 0, [(bytes(h), 0) for h in cached.block_hashes[:3]], reflected_step=-1)
    first = make_request("a", 3 * BLOCK + 1, first_token=500)
    sched.num_new_matched_tokens(first, 0)
    assert len(stored(_prefill(sched, first, [1, 2, 3, 4]))) == 3
    sched.request_finished("a")
    for req_id, block_ids, waits in (("b", [11, 12, 13, 14], False),
                                     ("c", [2, 8, 9, 10], True)):  # 2: stored by "a"
        again = make_request(req_id, 3 * BLOCK + 1)  # the cached prompt: a hit
        tokens, load_async, _ = sched.num_new_matched_tokens(again, 0)
        assert (tokens, load_async) == (3 * BLOCK, True)
        sched.after_alloc(again, (block_ids,), tokens)
        assert sched.build_meta(output(scheduled=BUSY)).wait_for_stores is waits


def test_sliding_window_blocks_are_fenced_as_soon_as_they_are_stored(make_request):
    """vLLM frees a running request's blocks that leave the window: no finish needed."""
    sched = scheduler_for(vkv.SlidingWindowSpec(sliding_window=BLOCK, **ATTN))
    _ready(sched)
    first, meta = _admit(sched, make_request("a", 4 * BLOCK + 1), [1, 2, 3, 4, 5])
    ids = [block_id for _, block_id in stored(meta)]
    assert ids
    other = make_request("b", 2 * BLOCK, first_token=900)
    sched.num_new_matched_tokens(other, 0)
    assert _prefill(sched, other, [ids[0], 20]).wait_for_stores


def test_not_being_told_which_requests_were_preempted_waits_while_stores_are_in_flight():
    fence = StoreFence([full_attention().specs[0]])
    fence.unknown_free()
    assert not fence.must_wait([1], reflected=-1)  # nothing stored: nothing to wait for
    fence.stored(3, "a", 0, [1, 2], reflected=-1)
    fence.unknown_free()
    assert fence.must_wait([], reflected=2)
    assert not fence.must_wait([], reflected=2)  # once
    fence.unknown_free()
    assert not fence.must_wait([], reflected=3)  # step 3's stores were copied out


@pytest.mark.parametrize("seed", range(6))
def test_the_fence_waits_whenever_a_reallocated_block_may_still_be_read(make_request, seed):
    """A random workload over a vLLM-like block pool (FIFO free queue, frees at finish and
    preemption, workers that report their copies a random number of steps late), checked
    against an independent account of which blocks stores may still be reading."""
    rng = random.Random(seed)
    sched = _ready(full_attention())
    free = deque(range(1, 14))
    running: dict[str, list[int]] = {}
    reading: dict[int, int] = {}  # block -> last plan step storing it (ground truth)
    copied_through = -1  # what the workers reported
    steps_planned: list[int] = []
    waits = needed = 0
    for step in range(120):
        news, preempted, allocated = [], set(), []
        if running and rng.random() < 0.3:  # preempt or finish someone
            victim = rng.choice(sorted(running))
            free.extend(reversed(running.pop(victim)))
            if rng.random() < 0.5:
                preempted.add(victim)
            else:
                sched.request_finished(victim)
        scheduled = {}
        if len(free) >= 4 and rng.random() < 0.7:
            req_id = f"r{step}"
            request = make_request(req_id, rng.randrange(1, 4) * BLOCK + 1,
                                   first_token=rng.randrange(1, 10_000))
            ids = [free.popleft() for _ in range(-(-request.num_tokens // BLOCK))]
            allocated += ids
            sched.num_new_matched_tokens(request, 0)
            news.append(NewRequestData.from_request(request, (ids,)))
            scheduled[req_id] = request.num_tokens
            running[req_id] = ids
        meta = sched.build_meta(output(new=news, scheduled=scheduled or BUSY,
                                       preempted=preempted))
        for new in news:
            sched._requests[new.req_id].request.num_computed_tokens = scheduled[new.req_id]
        hazard = any(reading.get(b, -1) > copied_through for b in allocated)
        assert meta.wait_for_stores or not hazard, f"step {step}: a reused block may be read"
        waits += meta.wait_for_stores
        needed += hazard
        if meta.wait_for_stores:  # the workers waited: every store so far is copied out
            copied_through = max(copied_through, step - 1)
        for _, block_id in stored(meta):
            reading[block_id] = meta.step
        steps_planned.append(meta.step)
        if rng.random() < 0.25:  # a late report
            copied_through = max(copied_through, steps_planned[-1 - rng.randrange(0, 4)]
                                 if len(steps_planned) >= 4 else -1)
        report(sched, 0, reflected_step=copied_through)
    assert needed > 0  # the workload did exercise the hazard
    assert waits <= 3 * needed + 5  # and the fence is not simply always on


def test_a_block_vllm_zeroes_or_copies_into_waits_if_a_store_may_read_it(make_request):
    """vLLM zeroes fresh blocks and runs copy-on-write copies before the forward (after
    `handle_preemptions`): those writes count as much as a request's own."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    for extra in ({"new_block_ids_to_zero": [2]},
                  {"kv_cache_block_copies": [KVCacheBlockCopy(30, 2)]}):
        sched = full_attention()
        _ready(sched)
        first = make_request("a", 3 * BLOCK + 1)
        sched.num_new_matched_tokens(first, 0)
        _prefill(sched, first, [1, 2, 3, 4])
        sched.request_finished("a")
        step = output(scheduled=BUSY)
        assert not sched.build_meta(step).wait_for_stores
        step = output(scheduled=BUSY)
        for name, value in extra.items():
            setattr(step, name, value)
        assert sched.build_meta(step).wait_for_stores, extra
