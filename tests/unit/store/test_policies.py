"""LRU, segmented LRU and ARC policies, driven through the real OffloadManager.

ARC is compared with the algorithm as published (Megiddo & Modha, FAST '03,
Fig. 4), written here from the paper: one request at a time, REPLACE before the
new page enters, ghost lists trimmed first. The manager's ARC defers part of
that work to store completion; with one key per store completing at once the
two must agree exactly.
"""

from __future__ import annotations

import random

import pytest

from kv_offload.errors import EvictionPolicyError
from kv_offload.store.manager import OffloadManager, SlotState
from kv_offload.store.policies import ARCPolicy, LRUPolicy, SLRUPolicy, make_policy


class PaperARC:
    def __init__(self, c: int) -> None:
        self.c, self.p = c, 0.0
        self.t1: list = []  # LRU first
        self.t2: list = []
        self.b1: list = []
        self.b2: list = []

    def request(self, x) -> bool:
        """Returns whether x was a hit."""
        c = self.c
        if x in self.t1 or x in self.t2:  # Case I
            (self.t1 if x in self.t1 else self.t2).remove(x)
            self.t2.append(x)
            return True
        if x in self.b1:  # Case II
            delta = 1 if len(self.b1) >= len(self.b2) else len(self.b2) / len(self.b1)
            self.p = min(self.p + delta, c)
            self.replace(x)
            self.b1.remove(x)
            self.t2.append(x)
            return False
        if x in self.b2:  # Case III
            delta = 1 if len(self.b2) >= len(self.b1) else len(self.b1) / len(self.b2)
            self.p = max(self.p - delta, 0)
            self.replace(x)
            self.b2.remove(x)
            self.t2.append(x)
            return False
        # Case IV
        if len(self.t1) + len(self.b1) == c:
            if len(self.t1) < c:
                self.b1.pop(0)
                self.replace(x)
            else:
                self.t1.pop(0)
        else:
            total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
            if total >= c:
                if total == 2 * c:
                    self.b2.pop(0)
                self.replace(x)
        self.t1.append(x)
        return False

    def replace(self, x) -> None:
        if self.t1 and ((x in self.b2 and len(self.t1) == self.p) or len(self.t1) > self.p):
            self.b1.append(self.t1.pop(0))
        else:
            self.b2.append(self.t2.pop(0))


def request(manager: OffloadManager, key) -> bool:
    """What a connector does per block: a hit is touched, a miss is stored."""
    if manager.lookup([key]) == [SlotState.READY]:
        manager.touch([key])
        return True
    plan = manager.prepare_store([key])
    manager.complete_store(list(plan.keys), True)
    return False


def workload(rng: random.Random, n: int, universe: int) -> list:
    """Mixed phases: skewed reuse, loops larger than the cache, one-time scans."""
    out: list = []
    while len(out) < n:
        phase = rng.choice(["zipf", "loop", "scan", "uniform"])
        length = rng.randint(20, 300)
        if phase == "zipf":
            out += [int(rng.paretovariate(1.2)) % universe for _ in range(length)]
        elif phase == "loop":
            start, span = rng.randrange(universe), rng.randint(2, universe // 2)
            out += [(start + i % span) % universe for i in range(length)]
        elif phase == "scan":
            start = rng.randrange(10_000)
            out += [universe + start + i for i in range(length)]
        else:
            out += [rng.randrange(universe) for _ in range(length)]
    return [((x).to_bytes(4, "little"), x % 3) for x in out[:n]]


@pytest.mark.parametrize("capacity", [1, 2, 3, 5, 8, 16])
def test_arc_matches_the_paper_one_request_at_a_time(capacity):
    rng = random.Random(capacity)
    manager = OffloadManager(capacity, "arc")
    policy = manager.policy
    paper = PaperARC(capacity)
    for step, key in enumerate(workload(rng, 4000, 4 * capacity + 3)):
        hit = request(manager, key)
        assert hit == paper.request(key), step
        state = (list(policy.t1), list(policy.t2), list(policy.b1), list(policy.b2), policy.p)
        assert state == (paper.t1, paper.t2, paper.b1, paper.b2, paper.p), step
        resident = {k for k in paper.t1 + paper.t2}
        assert {k for k in resident if manager.lookup([k]) == [SlotState.READY]} == resident
        assert len(manager) == len(resident)


def test_lru_evicts_in_recency_order():
    manager = OffloadManager(3, "lru")
    keys = [(bytes([i]), 0) for i in range(6)]
    for key in keys[:3]:
        request(manager, key)
    request(manager, keys[0])  # hit: 0 becomes most recent
    request(manager, keys[3])  # evicts 1
    request(manager, keys[4])  # evicts 2
    assert manager.policy.order() == [keys[0], keys[3], keys[4]]
    removed = [e.keys for e in manager.take_events() if e.kind == "removed"]
    assert removed == [(keys[1],), (keys[2],)]


def hit_ratio(policy: str, requests: list, capacity: int) -> float:
    manager = OffloadManager(capacity, policy)
    return sum(request(manager, key) for key in requests) / len(requests)


def test_arc_keeps_a_reused_working_set_through_a_scan_that_flushes_lru():
    hot = [(b"hot%d" % i, 0) for i in range(6)]
    requests = []
    for round_ in range(20):
        requests += hot + hot  # reused: frequent
        requests += [(b"scan%d-%d" % (round_, i), 0) for i in range(10)]  # seen once
    lru, arc = hit_ratio("lru", requests, 10), hit_ratio("arc", requests, 10)
    # LRU: a 10-key scan pushes the 6 hot keys out of a 10-slot tier every round
    assert arc > lru + 0.2, (arc, lru)


def test_slru_keeps_a_reused_working_set_through_a_scan_that_flushes_lru():
    hot = [(b"hot%d" % i, 0) for i in range(6)]
    requests = []
    for round_ in range(20):
        requests += hot + hot
        requests += [(b"scan%d-%d" % (round_, i), 0) for i in range(10)]
    lru, slru = hit_ratio("lru", requests, 10), hit_ratio("slru", requests, 10)
    assert slru > lru + 0.2, (slru, lru)


def test_slru_evicts_keys_stored_once_before_keys_that_served_a_hit():
    manager = OffloadManager(4)  # the default policy
    assert isinstance(manager.policy, SLRUPolicy)
    keys = [(bytes([i]), 0) for i in range(8)]
    for key in keys[:4]:
        request(manager, key)
    manager.touch([keys[0]])  # protected, though the least recently stored
    request(manager, keys[4])  # evicts 1, the oldest key in probation
    request(manager, keys[5])  # then 2
    assert manager.policy.order() == [keys[3], keys[4], keys[5], keys[0]]
    # the protected segment holds at most 80% (3 of 4 keys): the 4th touch demotes its
    # least recent key to probation's most recent end
    manager.touch([keys[3], keys[4], keys[5]])
    assert list(manager.policy.probation) == [keys[0]]
    assert list(manager.policy.protected) == [keys[3], keys[4], keys[5]]


def test_a_key_touched_while_its_store_is_in_flight_is_protected_when_it_lands():
    manager = OffloadManager(3, "slru")
    key, other = (b"k", 0), (b"o", 0)
    manager.prepare_store([key, other])
    manager.touch([key])  # a lookup's hit found it planned: protect it once it is ready
    manager.complete_store([key, other], True)
    assert list(manager.policy.protected) == [key]
    assert list(manager.policy.probation) == [other]


def test_lru_policy_skips_keys_that_may_not_go():
    policy = LRUPolicy(4)
    for key in "abcd":
        policy.inserted(key)
    policy.touched("a")
    assert policy.evict(["x", "y"], lambda key: key != "b") == ["c", "d"]
    assert policy.order() == ["b", "a"]


def test_arc_falls_back_to_the_other_list_when_its_choice_is_pinned():
    policy = ARCPolicy(4)
    for key in "abc":
        policy.inserted(key)
    policy.touched("c")  # T1 = [a, b], T2 = [c]; |T1| > p = 0: REPLACE picks T1
    assert policy.evict(["x"], lambda key: key == "c") == ["c"]
    assert list(policy.b2) == ["c"]


def test_make_policy_accepts_names_paths_and_instances():
    assert isinstance(make_policy("lru", 3), LRUPolicy)
    assert isinstance(make_policy("kv_offload.store.policies:ARCPolicy", 3), ARCPolicy)
    instance = ARCPolicy(3)
    assert make_policy(instance, 3) is instance
    assert isinstance(make_policy("slru", 3), SLRUPolicy)
    with pytest.raises(EvictionPolicyError, match="accepted: arc, lru, slru"):
        make_policy("LRU ", 3)
    with pytest.raises(EvictionPolicyError, match="name or an EvictionPolicy"):
        make_policy(42, 3)
    with pytest.raises(EvictionPolicyError, match="capacity"):
        LRUPolicy(0)
