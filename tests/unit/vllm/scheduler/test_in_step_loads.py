"""Which hits load inside the step that schedules their request (`InStepLoads`), driven
through `OffloadScheduler` with vLLM's real Request and spec classes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kv_offload.vllm.scheduler.in_step_loads import InStepLoads  # noqa: E402
from kv_offload.vllm.scheduler.offload_scheduler import OffloadScheduler  # noqa: E402
from kv_offload.vllm.spec_translation import translate_groups  # noqa: E402

from helpers.vllm_scheduler_helpers import (  # noqa: E402
    ATTN,
    IN_HOST,
    ON_DISK,
    keys,
    output,
    report,
    request_factory,
    run_hit,
    vkv,
)

BLOCK_BYTES = 8192  # one block of the group on a rank (any value: the test sets budgets)


def scheduler(*vllm_specs, budget: int, world_size: int = 1, read_budget_s: float = 0.0
              ) -> OffloadScheduler:
    config = vkv.KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[],
        kv_cache_groups=[vkv.KVCacheGroupSpec([f"layers.{g}"], spec)
                         for g, spec in enumerate(vllm_specs)])
    specs = [g.spec for g in translate_groups(config)]
    return OffloadScheduler(specs, 32, world_size, in_step=InStepLoads(
        specs, [BLOCK_BYTES] * len(specs), budget, read_budget_s=read_budget_s,
        world_size=world_size))


def hit_of(sched, where=IN_HOST, ranks=(0,), held_blocks=range(4)):
    make = request_factory()
    request = make("r", 32 * 5 + 7)
    for rank in ranks:
        report(sched, rank, keys(request, held_blocks), new=where)
    return run_hit(sched, request, ([1, 2, 3, 4, 5, 6],))


def test_a_host_hit_within_the_budget_loads_in_the_step():
    sched = scheduler(vkv.FullAttentionSpec(**ATTN), budget=4 * BLOCK_BYTES)
    assert hit_of(sched) == (128, False)
    meta = sched.build_meta(output())
    assert meta.in_step == ["r"] and list(meta.loads) == ["r"]
    assert not sched.is_loading("r")  # vLLM runs it now: its blocks are not held back


@pytest.mark.parametrize("why", ["over budget", "on disk", "one rank short", "off"])
def test_otherwise_the_hit_loads_asynchronously(why):
    budget = {"over budget": 3 * BLOCK_BYTES, "off": 0}.get(why, 4 * BLOCK_BYTES)
    sched = scheduler(vkv.FullAttentionSpec(**ATTN), budget=budget, world_size=2)
    report(sched, 1, [])  # (rank 1 reports too: lookups may answer)
    where = ON_DISK if why == "on disk" else IN_HOST
    ranks = (0,) if why == "one rank short" else (0, 1)
    if why == "one rank short":  # rank 1 holds the blocks on disk only
        report(sched, 1, keys(request_factory()("r", 32 * 5 + 7), range(4)), new=ON_DISK)
    assert hit_of(sched, where, ranks) == (128, True)
    meta = sched.build_meta(output())
    assert meta.in_step == [] and list(meta.loads) == ["r"]
    assert sched.is_loading("r")


def test_while_a_rank_reports_stalled_copies_hits_load_asynchronously_until_they_end():
    # A rank that gave an in-step load up at its bound (a stalled copy thread) and still
    # runs it: a new in-step load there would wait the same bound, stalling the batch.
    sched = scheduler(vkv.FullAttentionSpec(**ATTN), budget=4 * BLOCK_BYTES, world_size=2)
    make = request_factory()
    first, second = make("first", 32 * 5 + 7), make("second", 32 * 5 + 7, first_token=500)
    for rank in (0, 1):
        report(sched, rank, keys(first, range(4)) + keys(second, range(4)))
    report(sched, 1, [], stalled=("earlier",))
    assert run_hit(sched, first, ([1, 2, 3, 4, 5, 6],)) == (128, True)
    assert sched.build_meta(output()).in_step == []
    report(sched, 1, [])  # its given-up load ended
    assert run_hit(sched, second, ([7, 8, 9, 10, 11, 12],)) == (128, False)
    assert sched.build_meta(output()).in_step == ["second"]


def _in_step_hit_on_two_ranks(sched, req_id: str, first_token: int = 1):
    """`req_id` hits in both ranks' host memory and loads in-step; the step of its load."""
    request = request_factory()(req_id, 32 * 5 + 7, first_token=first_token)
    for rank in (0, 1):
        report(sched, rank, keys(request, range(4)))
    assert run_hit(sched, request, ([1, 2, 3, 4, 5, 6],)) == (128, False)
    meta = sched.build_meta(output())
    assert meta.in_step == [req_id]
    return meta.step


def test_a_request_ending_while_a_rank_still_copies_its_given_up_load_keeps_its_blocks():
    # Rank 1 gave the in-step load up at its bound; a copy of it may still run there. Its
    # blocks must not go to another request until rank 1 says that copy ended.
    sched = scheduler(vkv.FullAttentionSpec(**ATTN), budget=4 * BLOCK_BYTES, world_size=2)
    step = _in_step_hit_on_two_ranks(sched, "r")
    report(sched, 0, [], step=step)
    report(sched, 1, [], step=step, stalled=("r",))
    assert sched.request_finished("r") is True  # vLLM keeps its blocks
    assert sched.build_meta(output()).held == ["r"]  # each rank reports it back when free
    assert sched.build_meta(output()).held == []  # (once)
    sched.loads_finished({"r"}, set())  # every rank did: vLLM frees the blocks
    assert not sched.is_loading("r") and "r" not in sched._requests


def test_a_request_ending_before_every_rank_reported_on_its_in_step_load_keeps_its_blocks():
    sched = scheduler(vkv.FullAttentionSpec(**ATTN), budget=4 * BLOCK_BYTES, world_size=2)
    step = _in_step_hit_on_two_ranks(sched, "r")
    report(sched, 0, [], step=step)
    report(sched, 1, [], step=step - 1)  # (e.g. aborted while that step still runs)
    assert sched.request_finished("r") is True
    assert sched.build_meta(output()).held == ["r"]


def test_a_request_vllm_ended_for_its_output_before_the_reports_is_held_only_if_it_failed():
    # vLLM rewinds a request whose in-step load failed on any rank before it looks at its
    # output: ending for its own output in the load's step means that load succeeded.
    sched = scheduler(vkv.FullAttentionSpec(**ATTN), budget=4 * BLOCK_BYTES, world_size=2)
    step = _in_step_hit_on_two_ranks(sched, "r")
    assert sched.request_finished("r", ended_by_output=True) is False
    step = _in_step_hit_on_two_ranks(sched, "s", first_token=600)  # (blocks 1-4 again)
    sched.blocks_failed({3, 40})  # a rank failed a block of it: rewound, then ran again
    assert sched.request_finished("s", ended_by_output=True) is True
    for rank in (0, 1):
        report(sched, rank, [], step=step)  # every rank reported on that step
    assert not sched._in_step_pending  # (nothing left to look through for failures)


def test_a_request_whose_in_step_load_every_rank_finished_frees_its_blocks_at_once():
    sched = scheduler(vkv.FullAttentionSpec(**ATTN), budget=4 * BLOCK_BYTES, world_size=2)
    step = _in_step_hit_on_two_ranks(sched, "r")
    for rank in (0, 1):
        report(sched, rank, [], step=step, stalled=("another",) if rank else ())
    assert sched.request_finished("r") is False
    assert sched.build_meta(output()).held == []


def test_a_step_handing_out_a_block_a_preempted_requests_given_up_load_may_write_waits():
    # vLLM frees a preempted request's blocks at once (no connector is asked), so those a
    # given-up in-step load may still write are fenced: the forward that reuses one waits.
    sched = scheduler(vkv.FullAttentionSpec(**ATTN), budget=4 * BLOCK_BYTES, world_size=2)
    step = _in_step_hit_on_two_ranks(sched, "r")  # (fills blocks 1-4)
    report(sched, 0, [], step=step)
    report(sched, 1, [], step=step, stalled=("r",))
    other = request_factory()("other", 100, first_token=900)
    sched.num_new_matched_tokens(other, 0)
    sched.after_alloc(other, ([20, 21],), 0)  # (untouched blocks)
    assert sched.build_meta(output(preempted=["r"])).wait_for_loads is False
    sched.after_alloc(other, ([3, 22],), 0)  # block 3: vLLM reuses one of r's
    assert sched.build_meta(output()).wait_for_loads is True
    report(sched, 1, [], step=step + 2)  # rank 1's given-up load ended
    sched.after_alloc(other, ([2],), 0)
    assert sched.build_meta(output()).wait_for_loads is False
    assert not sched.in_step._fence  # (emptied: later steps check nothing)


MIB_PER_S = float(1 << 20)


@pytest.mark.parametrize("rates, in_step", [
    ((2 * MIB_PER_S, 1 * MIB_PER_S), True),  # 32 KiB at the slower 1 MiB/s: 31 ms <= 40 ms
    ((2 * MIB_PER_S, 0.5 * MIB_PER_S), False),  # 62 ms: over the read budget
    ((2 * MIB_PER_S, 0.0), False),  # rank 1 has not read anything yet: no figure
])
def test_a_disk_hit_loads_in_step_only_when_every_rank_reads_it_within_the_read_budget(
        rates, in_step):
    sched = scheduler(vkv.FullAttentionSpec(**ATTN), budget=4 * BLOCK_BYTES, world_size=2,
                      read_budget_s=0.04)
    for rank, rate in enumerate(rates):
        report(sched, rank, read_bytes_per_s=rate)
    assert hit_of(sched, ON_DISK, ranks=(0, 1)) == (128, not in_step)
    meta = sched.build_meta(output())
    assert meta.in_step == (["r"] if in_step else []) and list(meta.loads) == ["r"]


def test_only_the_blocks_read_from_disk_count_against_the_read_budget():
    sched = scheduler(vkv.FullAttentionSpec(**ATTN), budget=4 * BLOCK_BYTES,
                      read_budget_s=0.01)
    report(sched, 0, read_bytes_per_s=MIB_PER_S)  # 8 KiB: 7.8 ms, 32 KiB: 31 ms
    make = request_factory()
    request = make("r", 32 * 5 + 7)
    report(sched, 0, keys(request, range(3)), new=IN_HOST)
    report(sched, 0, keys(request, [3]), new=ON_DISK)
    assert run_hit(sched, request, ([1, 2, 3, 4, 5, 6],)) == (128, False)
    report(sched, 0, keys(request, [2]), new=ON_DISK)  # (evicted from host: 2 blocks on disk)
    assert sched.num_new_matched_tokens(make("s", 32 * 5 + 7), 0)[:2] == (128, True)


def test_models_with_several_groups_or_mamba_states_always_load_asynchronously():
    window = vkv.SlidingWindowSpec(sliding_window=64, **ATTN)
    two_groups = scheduler(vkv.FullAttentionSpec(**ATTN), window, budget=1 << 30)
    assert not two_groups.in_step.enabled
    mamba = vkv.MambaSpec(block_size=32, shapes=((3, 64),), dtypes=(ATTN["dtype"],))
    assert not scheduler(mamba, budget=1 << 30).in_step.enabled


def test_an_in_step_hit_that_cannot_be_planned_is_reported_by_its_blocks_not_its_request():
    sched = scheduler(vkv.FullAttentionSpec(**ATTN), budget=4 * BLOCK_BYTES)
    make = request_factory()
    request = make("r", 32 * 5 + 7)
    report(sched, 0, keys(request, range(4)))
    tokens, load_async, _ = sched.num_new_matched_tokens(request, 0)
    assert (tokens, load_async) == (128, False)
    sched.fail_load("r", [1, 2, 3, 4, 5, 6])  # (the connector's fallback: after_alloc failed)
    meta = sched.build_meta(output())
    # vLLM runs "r" in this step: a request-level failure would be a protocol error.
    assert meta.failed_loads == [] and meta.in_step == [] and meta.failed_blocks == [1, 2, 3,
                                                                                      4, 5, 6]
    assert sched.build_meta(output()).failed_blocks == []  # once


def test_the_worker_reports_unplanned_in_step_blocks_and_knows_this_steps_in_step_blocks():
    from unit.vllm.worker.test_worker_side import Engine, make_worker

    worker = make_worker(Engine())
    try:
        worker.start_loads({}, failed_blocks=[3, 4])
        assert worker.in_step_blocks == {3, 4}
        assert worker.take_block_errors() == {3, 4}
        assert worker.take_block_errors() == set()
        assert worker.finished_loads() == (set(), set())  # nothing by request
    finally:
        worker.shutdown()


def test_a_step_that_schedules_no_tokens_is_marked_idle_for_the_workers():
    sched = scheduler(vkv.FullAttentionSpec(**ATTN), budget=0)  # (every load asynchronous)
    assert hit_of(sched) == (128, True)
    meta = sched.build_meta(output())  # the request waits for its load: nothing runs
    assert list(meta.loads) == ["r"] and meta.idle
    assert not sched.build_meta(output(scheduled={"r": 39})).idle  # now it runs
