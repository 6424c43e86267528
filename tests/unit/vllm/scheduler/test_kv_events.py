"""KV events of our tiers (kv_offload/vllm/scheduler/kv_events.py), driven through the
scheduler side with vLLM's real Request, SchedulerOutput, event classes and block pool; no engine is
started (tests/e2e/test_kv_events.py runs the real engine and publisher)."""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from kv_offload.types import KeyChange  # noqa: E402
from kv_offload.vllm.metadata import KVOffloadWorkerMetadata, RankReport  # noqa: E402
from kv_offload.vllm.scheduler.kv_events import (  # noqa: E402
    PENDING_STEPS,
    GroupEventSpec,
    KVEvents,
    KVEventTracker,
    group_event_specs,
)
from kv_offload.vllm.scheduler.rank_keys import RankKeys  # noqa: E402

from helpers.vllm_scheduler_helpers import (  # noqa: E402
    ABSENT,
    ATTN,
    BLOCK,
    IN_HOST,
    ON_DISK,
    NewRequestData,
    full_attention,
    keys,
    mixed_block_sizes,
    output,
    rank_meta,
    request_factory,
    run_hit,
    vkv,
)

FULL = GroupEventSpec(BLOCK, "full_attention")


@pytest.fixture
def make_request():
    return request_factory()


def with_events(sched, groups=(FULL,), storage_name="filesystem") -> KVEventTracker:
    """Attach a tracker to a scheduler built by the helpers (as the connector does)."""
    sched.events = KVEventTracker(list(groups), BLOCK, storage_name)
    return sched.events


def prompt_planned(make_request, tokens: int, block_ids: list[int], **events):
    """A full-attention scheduler with events on, its rank reported, and one request "r" of
    `tokens` whose whole prompt ran in one step: (scheduler, tracker, request, planned keys)."""
    sched = full_attention()
    tracker = with_events(sched, **events)
    apply(sched, 0, [])
    request = make_request("r", tokens)
    return sched, tracker, request, plan_prefill(sched, request, block_ids)


def plan_prefill(sched, request, block_ids):
    """The request runs its whole prompt in one step; returns the planned store keys."""
    sched.num_new_matched_tokens(request, 0)
    new = NewRequestData.from_request(request, (block_ids,))
    meta = sched.build_meta(output(new=[new], scheduled={request.request_id:
                                                          request.num_tokens}))
    request.num_computed_tokens = request.num_tokens
    return [(h, g) for g, (hashes, _) in meta.stores.items() for h in hashes]


def apply(sched, rank, changes, reset=False):
    sched.apply_worker_meta(KVOffloadWorkerMetadata(
        {rank: RankReport.of(changes, reset, -1)}))


def host(keys_, in_storage=False):
    return [KeyChange(k, IN_HOST, in_storage) for k in keys_]


def at(keys_, location):
    return [KeyChange(k, location) for k in keys_]


def published(keys_):
    """Block hashes as vLLM publishes its own (64-bit ints unless
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    return [maybe_convert_block_hash(h) for h, _ in keys_]


def by_medium(events, kind, medium):
    return [e for e in events if isinstance(e, kind) and e.medium == medium]


# --- what a store event carries ---

def test_a_block_stored_in_host_memory_is_announced_as_vllm_announces_its_own_block(
        make_request):
    sched = full_attention()
    tracker = with_events(sched)
    apply(sched, 0, [])
    request = make_request("r", 100)  # 3 full blocks + 4 tokens
    planned = plan_prefill(sched, request, [7, 8, 9, 10])
    assert planned == keys(request, [0, 1, 2])
    assert tracker.take() == []  # planned is not stored: nothing until the report

    apply(sched, 0, host(planned))
    ours = tracker.take()
    # vLLM's own block pool caching the same request's blocks ("GPU" events)
    pool = BlockPool(16, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(request, blocks, 0, 3, BLOCK, 0)
    (gpu,) = pool.take_events()
    assert [e.medium for e in ours] == ["CPU"] * 3
    assert [h for e in ours for h in e.block_hashes] == gpu.block_hashes
    assert ours[0].parent_block_hash is None and gpu.parent_block_hash is None
    assert [e.parent_block_hash for e in ours[1:]] == gpu.block_hashes[:2]
    assert [t for e in ours for t in e.token_ids] == gpu.token_ids == list(range(1, 97))
    for event in ours:
        assert (event.block_size, event.group_idx, event.kv_cache_spec_kind,
                event.ownership, event.lora_id) == (BLOCK, 0, "full_attention", None, None)


def test_a_host_key_written_through_is_announced_in_the_storage_medium_with_its_tier_name(
        make_request):
    sched, tracker, request, planned = prompt_planned(
        make_request, 64, [1, 2], storage_name="valkey")
    apply(sched, 0, host(planned))
    assert len(by_medium(tracker.take(), BlockStored, "CPU")) == 2
    apply(sched, 0, host(planned, in_storage=True))  # the write-through finished
    events = tracker.take()
    assert [e.medium for e in events] == ["STORAGE", "STORAGE"]
    assert [e.ownership for e in events] == ["valkey", "valkey"]
    assert [e.block_hashes[0] for e in events] == published(planned)
    assert events[1].token_ids == list(range(33, 65)) and events[1].block_size == BLOCK


def test_groups_with_larger_blocks_use_vllms_hash_for_the_whole_block(make_request):
    sched = mixed_block_sizes()  # group 0: window 64, 32-token blocks; group 1: 64-token
    tracker = with_events(sched, [GroupEventSpec(BLOCK, "sliding_window", 64),
                                  GroupEventSpec(2 * BLOCK, "full_attention")])
    apply(sched, 0, [])
    request = make_request("r", 130)
    sched.num_new_matched_tokens(request, 0)
    new = NewRequestData.from_request(request, ([1, 2, 3, 4, 5], [6, 7, 8]))
    meta = sched.build_meta(output(new=[new], scheduled={"r": 130}))
    group1 = [(h, 1) for h in meta.stores[1][0]]
    apply(sched, 0, host(group1))
    events = [e for e in tracker.take() if e.group_idx == 1]
    pool = BlockPool(16, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
    pool.cache_full_blocks(request, pool.get_new_blocks(3), 0, 2, 2 * BLOCK, 1)
    (gpu,) = pool.take_events()
    assert [e.block_hashes[0] for e in events] == gpu.block_hashes
    assert [t for e in events for t in e.token_ids] == gpu.token_ids
    assert events[1].parent_block_hash == gpu.block_hashes[0]
    assert {e.block_size for e in events} == {2 * BLOCK}


# --- when events fire ---

def test_evictions_are_removals_per_medium_and_a_read_back_is_announced_with_its_payload(
        make_request):
    sched, tracker, request, planned = prompt_planned(make_request, 64, [1, 2])
    apply(sched, 0, host(planned, in_storage=True))
    first = tracker.take()
    assert sorted(e.medium for e in first) == ["CPU", "CPU", "STORAGE", "STORAGE"]

    apply(sched, 0, at(planned[:1], ON_DISK))  # evicted from host memory, still on disk
    (removed,) = tracker.take()
    assert isinstance(removed, BlockRemoved)
    assert (removed.medium, removed.block_hashes, removed.group_idx) == \
        ("CPU", published(planned[:1]), 0)

    apply(sched, 0, host(planned[:1], in_storage=True))  # read back into host memory
    (again,) = tracker.take()
    assert again.medium == "CPU" and again == by_medium(first, BlockStored, "CPU")[0]

    apply(sched, 0, at(planned, ABSENT))  # gone from every tier
    events = tracker.take()
    assert [(e.medium, e.block_hashes) for e in events] == [
        ("CPU", published(planned)), ("STORAGE", published(planned))]
    assert tracker.num_payloads == 0  # nothing kept for blocks no tier holds


def test_a_block_is_stored_only_once_every_rank_holds_it(make_request):
    sched = full_attention(world_size=2)
    tracker = with_events(sched)
    request = make_request("r", 64)
    apply(sched, 0, [])
    apply(sched, 1, [])
    planned = plan_prefill(sched, request, [1, 2])
    apply(sched, 0, host(planned))
    assert tracker.take() == []  # rank 1 does not hold them yet: not loadable
    apply(sched, 1, host(planned[:1]))
    assert [e.block_hashes for e in tracker.take()] == [published(planned[:1])]
    apply(sched, 0, at(planned, ABSENT))  # one rank losing a block removes it
    (removed,) = tracker.take()
    assert removed.block_hashes == published(planned[:1]) and removed.medium == "CPU"


def test_both_ranks_reporting_in_one_step_announce_a_block_once(make_request):
    sched = full_attention(world_size=2)
    tracker = with_events(sched)
    request = make_request("r", 40)
    sched.apply_worker_meta(rank_meta(0).aggregate(rank_meta(1)))
    planned = plan_prefill(sched, request, [1, 2])
    sched.apply_worker_meta(rank_meta(0, planned).aggregate(rank_meta(1, planned)))
    assert len(tracker.take()) == 1


def test_a_reset_removes_every_block_its_rank_held(make_request):
    sched, tracker, request, planned = prompt_planned(make_request, 96, [1, 2, 3])
    apply(sched, 0, host(planned, in_storage=True))
    tracker.take()
    apply(sched, 0, [], reset=True)
    events = tracker.take()
    assert {(e.medium, tuple(sorted(e.block_hashes))) for e in events} == {
        (m, tuple(sorted(published(planned)))) for m in ("CPU", "STORAGE")}


def test_a_key_learnt_without_a_plan_gets_vllms_placeholder_payload():
    sched = full_attention()
    tracker = with_events(sched)
    apply(sched, 0, at([(b"\x01" * 32, 0)], ON_DISK))  # a disk inventory after a restart
    (event,) = tracker.take()
    assert (event.medium, event.block_hashes, event.parent_block_hash, event.token_ids,
            event.block_size) == ("STORAGE", published([(b"\x01" * 32, 0)]), None, [], 0)


def test_a_placeholder_block_loaded_by_a_request_is_read_back_with_its_payload(make_request):
    sched = full_attention()
    tracker = with_events(sched)
    apply(sched, 0, [])
    request = make_request("r", 100)
    on_disk = keys(request, [0, 1, 2])  # found on disk, stored by an earlier engine
    apply(sched, 0, at(on_disk, ON_DISK))
    assert [e.block_size for e in tracker.take()] == [0, 0, 0]
    tokens, load_async = run_hit(sched, request, ([4, 5, 6, 7],))
    assert (tokens, load_async) == (96, True)
    apply(sched, 0, host(on_disk, in_storage=True))  # the load read them into host memory
    events = tracker.take()
    assert [e.medium for e in events] == ["CPU"] * 3
    assert [e.token_ids for e in events] == [list(range(1 + 32 * i, 33 + 32 * i))
                                             for i in range(3)]
    assert [e.parent_block_hash for e in events] == [None, *published(on_disk[:2])]


def test_payloads_of_stores_that_never_land_are_dropped(make_request):
    sched = full_attention()
    tracker = with_events(sched)
    apply(sched, 0, [])
    plan_prefill(sched, make_request("r", 64), [1, 2])
    assert tracker.num_payloads == 2
    for _ in range(PENDING_STEPS - 1):
        apply(sched, 0, [])
    assert tracker.num_payloads == 2
    apply(sched, 0, [])
    assert tracker.num_payloads == 0


# --- cost, faults, events off ---

class CountingKeys(RankKeys):
    """The real RankKeys, counting the keys events look at."""

    looked_at = 0

    def held_by_all_mask(self, key):
        self.looked_at += 1
        return super().held_by_all_mask(key)


def test_a_report_costs_the_keys_it_names_not_the_keys_held():
    keys_ = CountingKeys(1)
    tracker = KVEventTracker([FULL], BLOCK)
    many = [(i.to_bytes(32, "little"), 0) for i in range(20_000)]
    tracker.apply_reports(keys_, {0: RankReport.of(host(many), False, 0)})
    assert len(tracker.take()) == 20_000
    keys_.looked_at = 0
    tracker.apply_reports(keys_, {0: RankReport.of(at(many[:3], ABSENT), False, 1)})
    assert keys_.looked_at == 6  # before and after, per key named
    (removed,) = tracker.take()
    assert removed.block_hashes == published(many[:3])


def test_a_fault_while_computing_events_loses_events_not_the_reports(make_request):
    sched = full_attention()
    tracker = with_events(sched)  # one group: a key of group 5 breaks the event payload
    apply(sched, 0, [])
    request = make_request("r", 64)
    bad = (bytes(request.block_hashes[0]), 5)
    apply(sched, 0, host([bad]))
    assert tracker.take() == []
    assert tracker.faults.take_counts() == {"events after report": 1}
    assert sched._keys.held_by_all(bad)  # applied all the same: hits stay right


def test_with_events_off_reports_are_applied_and_nothing_is_kept(make_request):
    sched = full_attention()
    assert type(sched.events) is KVEvents
    apply(sched, 0, [])
    request = make_request("r", 64)
    planned = plan_prefill(sched, request, [1, 2])
    apply(sched, 0, host(planned))
    assert sched.events.take() == []
    assert sched._keys.held_by_all(planned[0])


# --- on the wire ---

def test_events_encode_and_decode_as_vllms_publisher_sends_them(make_request):
    sched, tracker, request, planned = prompt_planned(make_request, 64, [1, 2])
    apply(sched, 0, host(planned, in_storage=True))
    apply(sched, 0, at(planned, ABSENT))
    events = tracker.take()
    wire = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=events))
    decoded = msgspec.msgpack.Decoder(type=KVEventBatch).decode(wire)
    assert decoded.events == events


def test_group_specs_come_from_vllms_kv_cache_config():
    config = vkv.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        vkv.KVCacheGroupSpec(["a"], vkv.FullAttentionSpec(**ATTN)),
        vkv.KVCacheGroupSpec(["b"], vkv.SlidingWindowSpec(sliding_window=64, **ATTN))])
    assert group_event_specs(config) == [GroupEventSpec(BLOCK, "full_attention", None),
                                         GroupEventSpec(BLOCK, "sliding_window", 64)]

