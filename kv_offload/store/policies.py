"""Eviction policies for one offload tier: which resident key leaves when a store needs room.

A policy sees keys only (never slots or bytes) and only *resident* keys, i.e.
keys whose store completed. The manager tells it every change and asks it for
victims, passing a predicate for what may go (not pinned by a load, not part of
the store that needs the room); it has already checked that enough such keys
exist. Select one with `make_policy("slru" | "lru" | "arc" |
"package.module:ClassName", capacity)`.

Hits reach a policy as `touched`: the connector touches the keys of every hit a lookup finds
(the blocks that hit would load in every group, deepest first and the first block last),
whether it loads them or vLLM's own cache already holds those tokens. For a hybrid model
those are the full-attention prefix and the sliding-window blocks right before the hit
point, never the sliding-window blocks no hit needs. The default, `slru`, keeps touched keys
in a protected segment, so what was stored once and never asked for again (a request's own
tail, sliding-window blocks far from every hit point) leaves before any servable prefix.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from kv_offload.errors import EvictionPolicyError

Key = Hashable
CanEvict = Callable[[Key], bool]


class EvictionPolicy(ABC):
    """Orders the resident keys of a tier holding at most `capacity` keys."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity <= 0:
            raise EvictionPolicyError(f"policy capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity

    def admitting(self, keys: Sequence[Key]) -> None:
        """`keys` (not resident) are about to be stored: each is a miss. Called
        once per accepted store plan, before `evict`. Default: nothing."""
        return None

    @abstractmethod
    def evict(self, incoming: Sequence[Key], can_evict: CanEvict) -> list[Key]:
        """Choose one victim per key of `incoming` (the new keys that find no free
        slot), each a resident key passing `can_evict`, and forget them."""

    @abstractmethod
    def inserted(self, key: Key) -> None:
        """`key` became resident (its store succeeded)."""

    @abstractmethod
    def touched(self, key: Key) -> None:
        """A resident `key` was hit."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every key and all history (the tier was cleared)."""


class LRUPolicy(EvictionPolicy):
    """Least recently stored or hit goes first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def evict(self, incoming: Sequence[Key], can_evict: CanEvict) -> list[Key]:
        victims = _oldest(self._order, len(incoming), can_evict)
        for key in victims:
            del self._order[key]
        return victims

    def inserted(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touched(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def reset(self) -> None:
        self._order.clear()

    def order(self) -> list[Key]:
        """Resident keys, least recently used first (for inspection and tests)."""
        return list(self._order)


class SLRUPolicy(EvictionPolicy):
    """Segmented LRU (Karedla, Love & Wherry, 1994): keys enter a probation segment; a hit
    moves a key to the protected segment, which holds at most `PROTECTED_SHARE` of the
    capacity (its least recent key goes back to the most recent end of probation when it
    overflows). Victims come from probation first, least recent first, then from protected.
    Keys stored once and never hit again therefore go before any key that served a hit, and
    protected keys still age out once others are hit more recently."""

    PROTECTED_SHARE = 0.8

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.protected_limit = max(1, int(capacity * self.PROTECTED_SHARE))
        self.probation: OrderedDict[Key, None] = OrderedDict()  # least recent first
        self.protected: OrderedDict[Key, None] = OrderedDict()

    def evict(self, incoming: Sequence[Key], can_evict: CanEvict) -> list[Key]:
        victims = _oldest(self.probation, len(incoming), can_evict)
        for key in victims:
            del self.probation[key]
        if len(victims) < len(incoming):
            more = _oldest(self.protected, len(incoming) - len(victims), can_evict)
            for key in more:
                del self.protected[key]
            victims += more
        return victims

    def inserted(self, key: Key) -> None:
        if key in self.protected:  # (stored again: a hit of a kind)
            self.protected.move_to_end(key)
            return
        self.probation[key] = None
        self.probation.move_to_end(key)

    def touched(self, key: Key) -> None:
        if key in self.protected:
            self.protected.move_to_end(key)
            return
        if key not in self.probation:
            return  # not resident
        del self.probation[key]
        self.protected[key] = None
        while len(self.protected) > self.protected_limit:
            demoted, _ = self.protected.popitem(last=False)
            self.probation[demoted] = None

    def reset(self) -> None:
        self.probation.clear()
        self.protected.clear()

    def order(self) -> list[Key]:
        """Resident keys in eviction order: probation, then protected, least recent first."""
        return [*self.probation, *self.protected]


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST '03).

    T1 holds keys seen once, T2 keys seen again (a hit, or a store of a key
    recently evicted); B1 and B2 remember recently evicted keys of each. A store
    of a key found in B1 grows the target size p of T1, one found in B2 shrinks
    it; a victim comes from T1 when T1 exceeds p, else from T2. With one key per
    request, no pins and stores that complete at once this is exactly ARC. The
    adaptations for a tier: a store adapts p when it is planned (`admitting`)
    and enters T1/T2 when it completes; a failed store leaves its ghost where it
    was; when the list REPLACE picks has nothing evictable (all pinned or
    protected), its other list gives the victim; ghost lists are trimmed when a
    new key enters, which is where ARC trims them too.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()  # LRU first in each list
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def admitting(self, keys: Sequence[Key]) -> None:
        for key in keys:
            if key in self.b1:
                self.p = min(self.capacity, self.p + max(1.0, len(self.b2) / len(self.b1)))
            elif key in self.b2:
                self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))

    def evict(self, incoming: Sequence[Key], can_evict: CanEvict) -> list[Key]:
        victims = []
        for key in incoming:
            from_t1 = bool(self.t1) and (
                len(self.t1) > self.p or (key in self.b2 and len(self.t1) == self.p))
            first, second = (self.t1, self.t2) if from_t1 else (self.t2, self.t1)
            for lst in (first, second):
                found = _oldest(lst, 1, can_evict)
                if found:
                    victim = found[0]
                    del lst[victim]
                    ghosts = self.b1 if lst is self.t1 else self.b2
                    ghosts[victim] = None
                    victims.append(victim)
                    break
            else:
                raise EvictionPolicyError(
                    f"ARC found no evictable key for {key!r}; the manager must only ask "
                    f"when enough resident keys can be evicted"
                )
        return victims

    def inserted(self, key: Key) -> None:
        if key in self.b1 or key in self.b2:  # seen before: frequent
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t2[key] = None
            return
        c = self.capacity
        if len(self.t1) + len(self.b1) >= c:
            if self.b1:
                self.b1.popitem(last=False)
        elif self._total() >= 2 * c and self.b2:
            self.b2.popitem(last=False)
        self.t1[key] = None

    def touched(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def reset(self) -> None:
        self.p = 0.0
        for lst in (self.t1, self.t2, self.b1, self.b2):
            lst.clear()

    def _total(self) -> int:
        return len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)


def _oldest(order: OrderedDict[Key, None], n: int, can_evict: CanEvict) -> list[Key]:
    """Up to n keys of `order` passing `can_evict`, oldest first."""
    found: list[Key] = []
    if n <= 0:
        return found
    for key in order:
        if can_evict(key):
            found.append(key)
            if len(found) == n:
                break
    return found


POLICIES: dict[str, type[EvictionPolicy]] = {"slru": SLRUPolicy, "lru": LRUPolicy,
                                             "arc": ARCPolicy}


def make_policy(policy: str | EvictionPolicy, capacity: int) -> EvictionPolicy:
    """A policy by name (`slru`, `lru`, `arc`), by import path (`package.module:ClassName`,
    an EvictionPolicy subclass taking the capacity), or an instance as is."""
    if isinstance(policy, EvictionPolicy):
        return policy
    if not isinstance(policy, str):
        raise EvictionPolicyError(
            f"eviction_policy must be a name or an EvictionPolicy, got {policy!r}")
    if policy in POLICIES:
        return POLICIES[policy](capacity)
    if ":" not in policy:
        raise EvictionPolicyError(
            f"unknown eviction_policy {policy!r}; accepted: {', '.join(sorted(POLICIES))}, "
            f"or an import path 'package.module:ClassName'"
        )
    module_name, _, class_name = policy.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise EvictionPolicyError(
            f"eviction_policy {policy!r} cannot be imported: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise EvictionPolicyError(
            f"eviction_policy {policy!r} is {cls!r}, not an EvictionPolicy subclass")
    return cls(capacity)
