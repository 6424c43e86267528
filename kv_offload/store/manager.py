"""Scheduler-side bookkeeping of one offload tier: keys, slots, pins, eviction.

No tensors here. A key is `(block_hash, group_index)`; a tier has `num_slots`
slots (for the CPU tier: indices into its host pool; a tiering layer runs one
manager per tier). Each key is ABSENT, STORING (a slot is reserved and being
written) or READY (its slot holds the bytes). The life of a key:

    prepare_store -> STORING -> complete_store(success) -> READY (or gone if failed)
    READY -> prepare_load (pin) ... complete_load (unpin); touch on hits
    READY and unpinned -> may be evicted by a later prepare_store

Guarantees: a slot is never handed out while its key is STORING, pinned by a
load, or part of the store that asks for room; a store is planned entirely or
not at all; a failed store leaves no trace; events record what became
loadable and what stopped being loadable, for vLLM's KV events.

`reset()` invalidates everything at once (e.g. new weights): afterwards every
old key looks ABSENT and cannot be loaded again. Slots still being read (pinned)
or written (STORING) stay reserved until their `complete_load` /
`complete_store`, so a load in progress keeps valid bytes to the end; a store
completing after a reset is discarded. Until then the same key cannot be stored
anew (a plan skips it), so one key never has two slots.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from kv_offload.errors import EvictionPolicyError, OffloadStateError
from kv_offload.store.policies import EvictionPolicy, LRUPolicy, make_policy
from kv_offload.types import OffloadKey

logger = logging.getLogger(__name__)


class SlotState(Enum):
    """A key's state in this tier's slots (where a key can be loaded from, across the
    tiers, is `kv_offload.types.Location`)."""

    ABSENT = "absent"
    STORING = "storing"
    READY = "ready"


@dataclass(frozen=True)
class StorePlan:
    """What a store must write: `keys[i]` goes to slot `slots[i]`. `evicted` left
    the tier to make room; `already_present` were in the request but are not
    written: READY or STORING already (or, after a reset, old copies still being
    read or written)."""

    keys: tuple[OffloadKey, ...]
    slots: tuple[int, ...]
    evicted: tuple[OffloadKey, ...]
    already_present: tuple[OffloadKey, ...]


@dataclass(frozen=True)
class OffloadEvent:
    """`stored`: keys became loadable in `tier`; `removed`: they no longer are."""

    kind: Literal["stored", "removed"]
    keys: tuple[OffloadKey, ...]
    tier: str


class _Entry:
    __slots__ = ("slot", "ready", "pins", "dropped", "touched")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.ready = False
        self.pins = 0
        self.dropped = False  # invalidated by reset(); freed once its I/O ends
        self.touched = False  # hit while STORING: the policy hears it once it is READY


class OffloadManager:
    """Slots of one tier and the keys in them."""

    def __init__(self, num_slots: int, policy: str | EvictionPolicy = "slru", *,
                 tier: str = "cpu", record_events: bool = True) -> None:
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots <= 0:
            raise OffloadStateError(f"num_slots must be a positive int, got {num_slots!r}")
        self.num_slots = num_slots
        self.tier = tier
        self.policy = make_policy(policy, num_slots)
        self._record_events = record_events
        self._entries: dict[OffloadKey, _Entry] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        # Every slot ever handed out is below this (freed slots are reused first, so the
        # host pool's pages past it were never written: `store/host/prefault.py`).
        self.high_water = 0
        self._num_evictable = 0  # READY, unpinned, not dropped
        self._events: list[OffloadEvent] = []
        self.policy_failures = 0  # plug-in policies replaced by LRU after a fault
        # Counts what can make a STORING key READY or ABSENT (a completed store, a reset):
        # a waiter for such keys re-checks them only once this moved (`store.loads`).
        self.settled = 0

    # --- queries ---

    def lookup(self, keys: Iterable[OffloadKey]) -> list[SlotState]:
        """The state of each key in this tier."""
        return [self._state(_checked(key)) for key in keys]

    def is_ready(self, key: OffloadKey) -> bool:
        """Whether one key can be loaded now: the fast check behind a hit lookup's
        `is_cached` (no key validation, no list)."""
        entry = self._entries.get(key)
        return entry is not None and entry.ready and not entry.dropped

    def slot_of(self, key: OffloadKey) -> int | None:
        """The slot of a READY key, else None."""
        entry = self._entries.get(key)
        return entry.slot if entry is not None and entry.ready and not entry.dropped else None

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Ready keys that a store could evict now (not pinned, not being written)."""
        return self._num_evictable

    def __len__(self) -> int:
        """Keys that are READY or STORING (visible ones)."""
        return sum(1 for e in self._entries.values() if not e.dropped)

    # --- loads ---

    def prepare_load(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Pin READY keys so their slots stay put while read; returns the slots.
        Every key must be READY (nothing is pinned otherwise). A key listed twice
        is pinned twice."""
        entries = [self._entries.get(_checked(key)) for key in keys]
        for key, entry in zip(keys, entries):
            if entry is None or not entry.ready or entry.dropped:
                raise OffloadStateError(
                    f"prepare_load: key {key!r} is {self._state(key).value} in tier "
                    f"{self.tier!r}; only ready keys can be loaded (look them up first)"
                )
        for entry in entries:
            if entry.pins == 0:
                self._num_evictable -= 1
            entry.pins += 1
        return [entry.slot for entry in entries]

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Unpin keys once read (one call per prepare_load of each key)."""
        for key, count in Counter(keys).items():
            entry = self._entries.get(key)
            pins = entry.pins if entry is not None else 0
            if pins < count:
                raise OffloadStateError(
                    f"complete_load: key {key!r} has {pins} load(s) in progress in tier "
                    f"{self.tier!r} but is completed {count} time(s) (a load completed "
                    f"twice, or never prepared)"
                )
        for key in keys:
            entry = self._entries[key]
            entry.pins -= 1
            if entry.pins == 0:
                if entry.dropped:
                    self._release(key)
                else:
                    self._num_evictable += 1

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Record a hit on keys, in order (the last is the most valuable). A STORING key
        is touched when its store completes; absent keys are ignored."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.dropped:
                continue
            if entry.ready:
                self._ask_policy("touched", key)
            else:
                entry.touched = True

    # --- stores ---

    def prepare_store(self, keys: Sequence[OffloadKey]) -> StorePlan | None:
        """Reserve slots for the keys not yet in the tier, evicting unpinned READY
        keys by policy if needed. Keys already present (and those of this very
        request) are never evicted for it. Returns None, changing nothing, when
        there is not enough room: the caller skips the store."""
        new: list[OffloadKey] = []
        present: list[OffloadKey] = []
        for key in dict.fromkeys(_checked(key) for key in keys):
            (present if key in self._entries else new).append(key)
        shortfall = len(new) - len(self._free)
        if shortfall > 0:
            protected_evictable = sum(1 for key in present if self._is_evictable(key))
            if self._num_evictable - protected_evictable < shortfall:
                return None
        self._ask_policy("admitting", new)
        victims: list[OffloadKey] = []
        if shortfall > 0:
            protected = set(present)
            def can_evict(key: OffloadKey) -> bool:
                return key not in protected and self._is_evictable(key)

            incoming = new[len(new) - shortfall:]
            victims = self._ask_policy("evict", incoming, can_evict)
            try:
                self._check_victims(victims, shortfall, protected)
            except EvictionPolicyError as exc:  # a plug-in broke its contract: fall back
                self._replace_policy(exc)
                victims = self.policy.evict(incoming, can_evict)
                self._check_victims(victims, shortfall, protected)
            for key in victims:
                self._num_evictable -= 1
                self._release(key)
            self._emit("removed", victims)
        slots = [self._free.pop() for _ in new]
        if slots:
            self.high_water = max(self.high_water, max(slots) + 1)
        for key, slot in zip(new, slots):
            self._entries[key] = _Entry(slot)
        return StorePlan(tuple(new), tuple(slots), tuple(victims), tuple(present))

    def complete_store(self, keys: Sequence[OffloadKey], success: bool) -> None:
        """Finish a store of keys planned by prepare_store: on success they become
        READY; on failure their slots are freed and nothing remains of them."""
        counts = Counter(keys)
        for key, count in counts.items():
            entry = self._entries.get(key)
            if entry is None or entry.ready or count > 1:
                state = "listed twice" if count > 1 else f"is {self._state(key).value}"
                raise OffloadStateError(
                    f"complete_store: key {key!r} {state} in tier {self.tier!r}; only keys "
                    f"of a planned store can be completed, once"
                )
        stored = []
        for key in keys:
            entry = self._entries[key]
            if success and not entry.dropped:
                entry.ready = True
                self._num_evictable += 1
                self._ask_policy("inserted", key)
                if entry.touched:
                    self._ask_policy("touched", key)
                stored.append(key)
            else:
                self._release(key)
        self.settled += 1
        self._emit("stored", stored)

    # --- reset and events ---

    def reset(self) -> None:
        """Invalidate every key (see the module docstring for keys being read or
        written at that moment)."""
        removed = []
        for key, entry in list(self._entries.items()):
            if entry.dropped:
                continue
            if entry.ready:
                removed.append(key)
            if entry.pins or not entry.ready:
                entry.dropped = True
            else:
                self._release(key)
        self._num_evictable = 0
        self.settled += 1
        self._ask_policy("reset")
        self._emit("removed", removed)

    def take_events(self) -> list[OffloadEvent]:
        """Events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # --- internals ---

    def _state(self, key: OffloadKey) -> SlotState:
        entry = self._entries.get(key)
        if entry is None or entry.dropped:
            return SlotState.ABSENT
        return SlotState.READY if entry.ready else SlotState.STORING

    def _is_evictable(self, key: OffloadKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready and not entry.pins and not entry.dropped

    def _release(self, key: OffloadKey) -> None:
        self._free.append(self._entries.pop(key).slot)

    def _check_victims(self, victims: list[OffloadKey], needed: int,
                       protected: set[OffloadKey]) -> None:
        """A plug-in policy that picks wrong victims must not corrupt the tier."""
        ok = len(victims) == needed == len(set(victims)) and all(
            key not in protected and self._is_evictable(key) for key in victims)
        if not ok:
            raise EvictionPolicyError(
                f"policy {type(self.policy).__name__} returned victims {victims!r} for "
                f"{needed} slot(s); expected {needed} distinct ready, unpinned keys outside "
                f"the store"
            )

    def _ask_policy(self, method: str, *args):
        """Call the eviction policy; a plug-in that raises is replaced by LRU over the
        ready keys (logged once), so a buggy policy costs hit rate, never the tier."""
        try:
            return getattr(self.policy, method)(*args)
        except Exception as exc:
            self._replace_policy(exc)
            return getattr(self.policy, method)(*args)

    def _replace_policy(self, error: Exception) -> None:
        logger.error("kv-offload tier %r: eviction policy %s failed (%s: %s); using lru "
                     "from now on", self.tier, type(self.policy).__name__,
                     type(error).__name__, error)
        self.policy_failures += 1
        self.policy = LRUPolicy(self.num_slots)
        for key, entry in self._entries.items():
            if entry.ready and not entry.dropped:
                self.policy.inserted(key)

    def _emit(self, kind: Literal["stored", "removed"], keys: list[OffloadKey]) -> None:
        if keys and self._record_events:
            self._events.append(OffloadEvent(kind, tuple(keys), self.tier))


def _checked(key: OffloadKey) -> OffloadKey:
    if (type(key) is not tuple or len(key) != 2 or not isinstance(key[0], bytes | int)
            or not isinstance(key[1], int) or key[1] < 0):
        raise OffloadStateError(
            f"offload key must be a (block_hash: bytes | int, group_index: int >= 0) "
            f"tuple, got {key!r}"
        )
    return key
