"""OffloadManager: every operation and its edges, on the real manager and policies."""

from __future__ import annotations

import pytest

from kv_offload.errors import ConfigError, EvictionPolicyError, OffloadStateError
from kv_offload.store.manager import OffloadEvent, OffloadManager, SlotState, StorePlan
from kv_offload.store.policies import EvictionPolicy, LRUPolicy

ABSENT, STORING, READY = SlotState.ABSENT, SlotState.STORING, SlotState.READY


def k(name: str, group: int = 0) -> tuple[bytes, int]:
    return (name.encode(), group)


A, B, C, D, E = (k(x) for x in "abcde")


def stored(manager: OffloadManager, *keys) -> None:
    plan = manager.prepare_store(list(keys))
    assert plan is not None
    manager.complete_store(list(plan.keys), True)


def test_store_lifecycle_lookup_and_events():
    m = OffloadManager(4, tier="cpu")
    assert m.lookup([A, B]) == [ABSENT, ABSENT]
    plan = m.prepare_store([A, B])
    assert plan == StorePlan((A, B), (0, 1), (), ())
    assert m.lookup([A, B, C]) == [STORING, STORING, ABSENT]
    assert m.slot_of(A) is None  # not readable yet
    m.complete_store([A, B], True)
    assert m.lookup([A, B]) == [READY, READY]
    assert m.is_ready(A) and not m.is_ready(C)
    assert (m.slot_of(A), m.slot_of(B)) == (0, 1)
    assert m.num_free_slots == 2 and len(m) == 2
    assert m.take_events() == [OffloadEvent("stored", (A, B), "cpu")]
    assert m.take_events() == []


def test_group_index_is_part_of_the_key():
    m = OffloadManager(4)
    stored(m, (b"h", 0))
    assert m.lookup([(b"h", 0), (b"h", 1), (7, 0)]) == [READY, ABSENT, ABSENT]


def test_full_pool_evicts_the_least_recently_used_and_reuses_its_slot():
    m = OffloadManager(2)
    stored(m, A)
    stored(m, B)
    m.touch([A])
    m.take_events()
    plan = m.prepare_store([C])
    assert plan.evicted == (B,) and plan.slots == (1,)  # B's slot
    assert m.lookup([A, B, C]) == [READY, ABSENT, STORING]
    assert m.take_events() == [OffloadEvent("removed", (B,), "cpu")]


def test_everything_pinned_returns_none_and_changes_nothing():
    m = OffloadManager(2)
    stored(m, A, B)
    m.prepare_load([A, B])
    m.take_events()
    assert m.prepare_store([C]) is None
    assert m.lookup([A, B, C]) == [READY, READY, ABSENT]
    assert m.num_free_slots == 0 and m.take_events() == []
    m.complete_load([A])
    assert m.prepare_store([C]).evicted == (A,)


def test_stores_in_flight_are_never_evicted():
    m = OffloadManager(2)
    assert m.prepare_store([A]) is not None  # in flight
    stored(m, B)
    assert m.prepare_store([C]).evicted == (B,)
    assert m.prepare_store([D]) is None  # A and C are both being written
    m.complete_store([A], True)
    assert m.prepare_store([D]).evicted == (A,)


def test_keys_already_present_are_kept_and_not_written_again():
    m = OffloadManager(3)
    stored(m, A)
    stored(m, B)
    stored(m, C)
    m.prepare_load([B, C])  # only A is evictable now
    assert m.prepare_store([A, D]) is None  # A is protected by its own store
    m.complete_load([B, C])
    plan = m.prepare_store([A, D])
    # A is the least recently used, but this store protects it: B goes instead
    assert plan == StorePlan((D,), (1,), (B,), (A,))
    # D is in flight: a second store of it writes nothing
    assert m.prepare_store([D]) == StorePlan((), (), (), (D,))


def test_store_plans_all_or_nothing():
    m = OffloadManager(3)
    stored(m, A, B)
    m.prepare_load([A])
    m.take_events()
    assert m.prepare_store([C, D, E]) is None  # needs 2 evictions, only B may go
    assert m.lookup([A, B, C, D, E]) == [READY, READY, ABSENT, ABSENT, ABSENT]
    assert m.num_free_slots == 1 and m.take_events() == []
    assert m.prepare_store([C, D]).evicted == (B,)


def test_duplicate_keys_in_one_store_take_one_slot():
    m = OffloadManager(4)
    plan = m.prepare_store([A, A, B, A])
    assert plan.keys == (A, B) and m.num_free_slots == 2


def test_failed_store_leaves_no_trace():
    m = OffloadManager(2)
    stored(m, A)
    m.take_events()
    before = (m.policy.order(), m.num_free_slots)
    plan = m.prepare_store([B])
    m.complete_store(list(plan.keys), False)
    assert m.lookup([B]) == [ABSENT]
    assert (m.policy.order(), m.num_free_slots) == before
    assert m.take_events() == []
    assert m.prepare_store([B]).slots == plan.slots  # the slot came back


def test_a_store_may_be_completed_in_parts():
    m = OffloadManager(4)
    m.prepare_store([A, B, C])
    m.complete_store([B], False)
    m.complete_store([A, C], True)
    assert m.lookup([A, B, C]) == [READY, ABSENT, READY]
    assert m.take_events() == [OffloadEvent("stored", (A, C), "cpu")]


def test_pins_are_counted():
    m = OffloadManager(1)
    stored(m, A)
    assert m.prepare_load([A]) == [0]
    assert m.prepare_load([A]) == [0]
    m.complete_load([A])
    assert m.prepare_store([B]) is None  # still one load in progress
    m.complete_load([A])
    assert m.prepare_store([B]).evicted == (A,)


def test_one_call_may_pin_a_key_twice():
    m = OffloadManager(1)
    stored(m, A)
    m.prepare_load([A, A])
    m.complete_load([A])
    assert m.prepare_store([B]) is None
    m.complete_load([A])
    with pytest.raises(OffloadStateError, match="0 load"):
        m.complete_load([A])


def test_prepare_load_needs_ready_keys_and_pins_nothing_on_error():
    m = OffloadManager(2)
    stored(m, A)
    m.prepare_store([B])
    with pytest.raises(OffloadStateError, match=r"key \(b'b', 0\) is storing"):
        m.prepare_load([A, B])
    with pytest.raises(OffloadStateError, match="is absent"):
        m.prepare_load([C])
    m.complete_store([B], True)
    assert m.prepare_store([C]).evicted == (A,)  # A was not left pinned


def test_completion_misuse_is_a_typed_error():
    m = OffloadManager(2)
    with pytest.raises(OffloadStateError, match="complete_load.*never prepared"):
        m.complete_load([A])
    with pytest.raises(OffloadStateError, match="complete_store.*is absent"):
        m.complete_store([A], True)
    m.prepare_store([A])
    with pytest.raises(OffloadStateError, match="listed twice"):
        m.complete_store([A, A], True)
    m.complete_store([A], True)
    with pytest.raises(OffloadStateError, match="complete_store.*is ready"):
        m.complete_store([A], True)  # double complete
    m.prepare_store([B])
    with pytest.raises(OffloadStateError):
        m.complete_store([B, C], True)  # C was never planned: nothing is applied
    assert m.lookup([B]) == [STORING]


def test_touch_ignores_keys_that_are_not_ready():
    m = OffloadManager(3)
    stored(m, A, B)
    m.prepare_store([C])
    m.touch([A, C, D])
    assert m.policy.order() == [B, A]


def test_reset_keeps_pinned_and_in_flight_slots_until_they_complete():
    m = OffloadManager(4)
    stored(m, A, B)
    slot_a = m.prepare_load([A])[0]
    m.prepare_store([C])
    m.take_events()
    m.reset()
    assert m.take_events() == [OffloadEvent("removed", (A, B), "cpu")]
    assert m.lookup([A, B, C]) == [ABSENT, ABSENT, ABSENT]
    assert not m.is_ready(A)
    assert m.num_free_slots == 2  # A (being read) and C (being written) keep theirs
    with pytest.raises(OffloadStateError):
        m.prepare_load([A])
    # the old copy of A is still being read: a new store of A must wait
    plan = m.prepare_store([A, D, E])
    assert plan.keys == (D, E) and plan.already_present == (A,)
    assert slot_a not in plan.slots
    m.complete_load([A])
    m.complete_store([C], True)  # written before the reset: discarded
    assert m.lookup([A, C]) == [ABSENT, ABSENT]
    assert m.num_free_slots == 2 and m.take_events() == []
    stored(m, A)
    assert m.lookup([A]) == [READY]


def test_reset_then_failed_and_double_completions():
    m = OffloadManager(2)
    stored(m, A)
    m.prepare_load([A])
    m.reset()
    m.complete_load([A])
    with pytest.raises(OffloadStateError):
        m.complete_load([A])
    assert m.num_free_slots == 2


def test_events_can_be_turned_off():
    m = OffloadManager(1, record_events=False)
    stored(m, A)
    stored(m, B)
    m.reset()
    assert m.take_events() == []


def test_bad_keys_and_sizes_are_typed_errors():
    m = OffloadManager(2)
    with pytest.raises(OffloadStateError, match="offload key must be"):
        m.lookup([b"just-a-hash"])
    with pytest.raises(OffloadStateError, match="offload key must be"):
        m.prepare_store([(b"h", -1)])
    with pytest.raises(OffloadStateError, match="num_slots"):
        OffloadManager(0)


def test_policy_names_and_import_paths():
    assert type(OffloadManager(2, "arc").policy).__name__ == "ARCPolicy"
    assert isinstance(OffloadManager(2, "kv_offload.store.policies:LRUPolicy").policy, LRUPolicy)
    with pytest.raises(ConfigError, match="unknown eviction_policy 'fifo'; accepted: arc, lru"):
        OffloadManager(2, "fifo")
    with pytest.raises(EvictionPolicyError, match="cannot be imported"):
        OffloadManager(2, "no_such_module_xyz:Policy")
    with pytest.raises(EvictionPolicyError, match="not an EvictionPolicy"):
        OffloadManager(2, "kv_offload.store.manager:OffloadManager")


class MostRecentFirst(EvictionPolicy):
    """An out-of-tree policy: evicts the most recently stored key."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.keys: list = []

    def evict(self, incoming, can_evict):
        victims = [key for key in reversed(self.keys) if can_evict(key)][: len(incoming)]
        for key in victims:
            self.keys.remove(key)
        return victims

    def inserted(self, key):
        self.keys.append(key)

    def touched(self, key):
        pass

    def reset(self):
        self.keys.clear()


def test_out_of_tree_policy_by_import_path_is_used():
    m = OffloadManager(2, f"{__name__}:MostRecentFirst")
    stored(m, A)
    stored(m, B)
    assert m.prepare_store([C]).evicted == (B,)


class PinnedVictim(MostRecentFirst):
    def evict(self, incoming, can_evict):
        return self.keys[: len(incoming)]  # ignores can_evict


def test_a_policy_choosing_a_pinned_victim_is_replaced_by_lru_and_the_store_goes_on():
    m = OffloadManager(2, PinnedVictim(2))
    stored(m, A, B)
    m.prepare_load([A])
    plan = m.prepare_store([C])  # the plug-in picks pinned A: refused, LRU picks B instead
    assert plan is not None and plan.evicted == (B,)
    assert m.lookup([A]) == [READY]
    assert m.policy_failures == 1 and isinstance(m.policy, LRUPolicy)
