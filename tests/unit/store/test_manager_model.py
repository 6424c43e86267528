"""Model-based test: the OffloadManager against a small independent reference,
over a long seeded run of random operations (all policies, pins, failures, resets).

After every operation it checks: key states equal the reference's; slots of
ready keys, of keys being written and of loads in progress are distinct, and
with the free slots they make up exactly the capacity; a plan never hands out a
held slot and never evicts a pinned, in-flight or protected key; the victims
and the policy's order (LRU list; SLRU's probation and protected lists; ARC's T1, T2, B1,
B2 and p) equal the reference's. A key touched while its store is in flight is touched
when the store completes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kv_offload.errors import OffloadStateError
from kv_offload.store.manager import OffloadManager, SlotState

OPS_PER_RUN = 55_000  # two runs: > 100k operations in all


class RefLRU:
    def __init__(self, c: int) -> None:
        self.order: list = []  # least recent first

    def admit(self, keys) -> None:
        pass

    def victims(self, incoming, can) -> list:
        chosen = [k for k in self.order if can(k)][: len(incoming)]
        self.order = [k for k in self.order if k not in chosen]
        return chosen

    def inserted(self, key) -> None:
        self.order.append(key)

    def touched(self, key) -> None:
        self.order.remove(key)
        self.order.append(key)

    def reset(self) -> None:
        self.order = []

    def snapshot(self, policy) -> bool:
        return policy.order() == self.order


class RefSLRU:
    """Segmented LRU: stores enter probation, a touch moves a key to protected (at most
    80% of the capacity, its oldest back to probation's end); victims from probation
    first."""

    def __init__(self, c: int) -> None:
        self.c, self.limit = c, max(1, int(c * 0.8))
        self.probation: list = []  # least recent first
        self.protected: list = []

    def admit(self, keys) -> None:
        pass

    def victims(self, incoming, can) -> list:
        chosen = [k for k in self.probation + self.protected if can(k)][: len(incoming)]
        self.probation = [k for k in self.probation if k not in chosen]
        self.protected = [k for k in self.protected if k not in chosen]
        return chosen

    def inserted(self, key) -> None:
        if key in self.protected:
            self.touched(key)
        else:
            self.probation.append(key)

    def touched(self, key) -> None:
        (self.probation if key in self.probation else self.protected).remove(key)
        self.protected.append(key)
        while len(self.protected) > self.limit:
            self.probation.append(self.protected.pop(0))

    def reset(self) -> None:
        self.__init__(self.c)

    def snapshot(self, policy) -> bool:
        return (list(policy.probation), list(policy.protected)) == (
            self.probation, self.protected)


class RefARC:
    """ARC as the manager applies it: p adapts when a store is planned, REPLACE
    per key that needs a slot (other list if nothing there may go), new keys
    enter T1 (ghosts: T2) when their store completes, ghosts trimmed then."""

    def __init__(self, c: int) -> None:
        self.c, self.p = c, 0.0
        self.t1: list = []
        self.t2: list = []
        self.b1: list = []
        self.b2: list = []

    def admit(self, keys) -> None:
        for x in keys:
            if x in self.b1:
                ratio = 1 if len(self.b1) >= len(self.b2) else len(self.b2) / len(self.b1)
                self.p = min(self.p + ratio, self.c)
            elif x in self.b2:
                ratio = 1 if len(self.b2) >= len(self.b1) else len(self.b1) / len(self.b2)
                self.p = max(self.p - ratio, 0)

    def victims(self, incoming, can) -> list:
        out = []
        for x in incoming:
            take_t1 = len(self.t1) > 0 and (
                len(self.t1) > self.p or (x in self.b2 and len(self.t1) == self.p))
            lists = [(self.t1, self.b1), (self.t2, self.b2)]
            for source, ghosts in (lists if take_t1 else lists[::-1]):
                movable = [k for k in source if can(k)]
                if movable:
                    source.remove(movable[0])
                    ghosts.append(movable[0])
                    out.append(movable[0])
                    break
        return out

    def inserted(self, x) -> None:
        if x in self.b1 or x in self.b2:
            (self.b1 if x in self.b1 else self.b2).remove(x)
            self.t2.append(x)
            return
        total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
        if len(self.t1) + len(self.b1) >= self.c:
            if self.b1:
                self.b1.pop(0)
        elif total >= 2 * self.c and self.b2:
            self.b2.pop(0)
        self.t1.append(x)

    def touched(self, x) -> None:
        (self.t1 if x in self.t1 else self.t2).remove(x)
        self.t2.append(x)

    def reset(self) -> None:
        self.__init__(self.c)

    def snapshot(self, policy) -> bool:
        return (list(policy.t1), list(policy.t2), list(policy.b1), list(policy.b2),
                policy.p) == (self.t1, self.t2, self.b1, self.b2, self.p)


@dataclass
class RefEntry:
    ready: bool = False
    pins: int = 0
    dropped: bool = False
    touched: bool = False


@dataclass
class RefTier:
    capacity: int
    policy: object
    entries: dict = field(default_factory=dict)

    def state(self, key) -> SlotState:
        e = self.entries.get(key)
        if e is None or e.dropped:
            return SlotState.ABSENT
        return SlotState.READY if e.ready else SlotState.STORING

    def evictable(self, key) -> bool:
        e = self.entries.get(key)
        return e is not None and e.ready and e.pins == 0 and not e.dropped

    def prepare_store(self, keys):
        unique = list(dict.fromkeys(keys))
        new = [k for k in unique if k not in self.entries]
        present = [k for k in unique if k in self.entries]
        shortfall = len(new) - (self.capacity - len(self.entries))
        allowed = {k for k in self.entries if self.evictable(k) and k not in present}
        if shortfall > 0 and len(allowed) < shortfall:
            return None
        self.policy.admit(new)
        victims = []
        if shortfall > 0:
            victims = self.policy.victims(new[len(new) - shortfall:], allowed.__contains__)
        for v in victims:
            del self.entries[v]
        for k in new:
            self.entries[k] = RefEntry()
        return new, victims, present

    def complete_store(self, keys, ok: bool) -> None:
        for k in keys:
            e = self.entries[k]
            if ok and not e.dropped:
                e.ready = True
                self.policy.inserted(k)
                if e.touched:
                    self.policy.touched(k)
            else:
                del self.entries[k]

    def complete_load(self, keys) -> None:
        for k in keys:
            e = self.entries[k]
            e.pins -= 1
            if e.pins == 0 and e.dropped:
                del self.entries[k]

    def reset(self) -> None:
        for k, e in list(self.entries.items()):
            if e.pins or not e.ready:
                e.dropped = True
            else:
                del self.entries[k]
        self.policy.reset()


class Harness:
    def __init__(self, policy: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.capacity = 6
        self.keys = [(i if i % 2 else i.to_bytes(2, "big"), i % 3) for i in range(16)]
        self.manager = OffloadManager(self.capacity, policy)
        ref_policy = {"lru": RefLRU, "slru": RefSLRU, "arc": RefARC}[policy](self.capacity)
        self.ref = RefTier(self.capacity, ref_policy)
        self.loads: list[tuple] = []     # (key, slot) per load in progress
        self.stores: dict = {}           # key -> slot, per key being written

    def pick(self, n: int) -> list:
        return [self.rng.choice(self.keys) for _ in range(n)]

    def held_slots(self) -> dict:
        """slot -> holder, from what the public API handed out."""
        held: dict = {}

        def hold(slot, holder):
            assert held.setdefault(slot, holder) == holder, (slot, holder, held[slot])

        for key, slot in self.loads:
            hold(slot, key)
        for key, slot in self.stores.items():
            hold(slot, key)
        for key in self.keys:
            slot = self.manager.slot_of(key)
            if slot is not None:
                hold(slot, key)
        return held

    def step(self) -> None:
        m, ref, rng = self.manager, self.ref, self.rng
        op = rng.choices(["store", "complete_store", "load", "complete_load", "touch",
                          "bad_load", "reset"], [30, 22, 18, 18, 10, 1, 0.2])[0]
        if op == "store":
            held = self.held_slots()
            keys = self.pick(rng.randint(1, 4))
            plan, expected = m.prepare_store(keys), ref.prepare_store(keys)
            if expected is None:
                assert plan is None
                return
            new, victims, present = expected
            assert (list(plan.keys), list(plan.evicted), list(plan.already_present)) == (
                new, victims, present)
            for victim in plan.evicted:
                assert victim not in self.stores and victim not in dict(self.loads)
            for key, slot in zip(plan.keys, plan.slots):
                assert held.get(slot) in (None, *plan.evicted), (slot, held.get(slot))
                self.stores[key] = slot
        elif op == "complete_store" and self.stores:
            keys = rng.sample(sorted(self.stores, key=repr), rng.randint(1, len(self.stores)))
            ok = rng.random() < 0.8
            m.complete_store(keys, ok)
            ref.complete_store(keys, ok)
            for key in keys:
                del self.stores[key]
        elif op == "load":
            ready = [k for k in self.keys if ref.state(k) is SlotState.READY]
            if ready:
                keys = rng.sample(ready, rng.randint(1, min(3, len(ready))))
                slots = m.prepare_load(keys)
                for key, slot in zip(keys, slots):
                    assert m.slot_of(key) == slot
                    ref.entries[key].pins += 1
                    self.loads.append((key, slot))
        elif op == "complete_load" and self.loads:
            done = rng.sample(self.loads, rng.randint(1, min(3, len(self.loads))))
            m.complete_load([key for key, _ in done])
            ref.complete_load([key for key, _ in done])
            for item in done:
                self.loads.remove(item)
        elif op == "touch":
            keys = self.pick(rng.randint(1, 3))
            m.touch(keys)
            for key in keys:
                if ref.state(key) is SlotState.READY:
                    ref.policy.touched(key)
                elif ref.state(key) is SlotState.STORING:
                    ref.entries[key].touched = True
        elif op == "bad_load":
            absent = [k for k in self.keys if ref.state(k) is not SlotState.READY]
            if absent:
                with pytest.raises(OffloadStateError):
                    m.prepare_load([rng.choice(absent)])
        elif op == "reset":
            m.reset()
            ref.reset()
        self.check()

    def check(self) -> None:
        m, ref = self.manager, self.ref
        assert m.lookup(self.keys) == [ref.state(k) for k in self.keys]
        assert [m.is_ready(k) for k in self.keys] == [
            ref.state(k) is SlotState.READY for k in self.keys]
        held = self.held_slots()
        assert len(held) + m.num_free_slots == self.capacity
        assert len(ref.entries) == len(held)
        for key, slot in self.loads:  # a pinned key still has its slot while visible
            if ref.state(key) is SlotState.READY:
                assert m.slot_of(key) == slot
        assert ref.policy.snapshot(m.policy)


@pytest.mark.parametrize("policy", ["slru", "lru", "arc"])
def test_manager_matches_reference_over_a_long_random_run(policy):
    harness = Harness(policy, seed=2024)
    for _ in range(OPS_PER_RUN):
        harness.step()
    events = harness.manager.take_events()
    assert {e.kind for e in events} == {"stored", "removed"}
