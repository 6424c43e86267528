"""The change feed of a tier: keys that became readable or stopped being readable.

Contents:
- `ChangeFeed`: records ``added`` / ``removed`` per key, coalesced (the latest state of a key
  wins), and hands them out in first-in first-out chunks of a bounded size (`take`).

Why a feed: the engine's step must cost what changed in that step, not what is stored. A tier
that can only be listed forces its caller to re-list (and diff) a million keys to notice the
few that changed; a feed hands over exactly the changes. The start-up inventory goes through
the same feed (recorded as ``added`` by the first scan), so a caller that takes a few thousand
keys per step learns a large directory over several steps instead of in one long pause.

Cost: ``added``/``removed`` are O(1) (``extend``: O(keys)), ``take`` is O(keys handed out);
both only take the feed's own lock, never a lock the tier's I/O paths hold for long, and never
do I/O. Memory is one entry per key changed and not yet taken (a key changed many times is one
entry).

The feed does not know what the caller already knows, so it never drops a change on its own:
a key added and removed again before a ``take`` is reported as removed (harmless for a caller
that never heard of it; required for one that learnt of it from its own write result).
"""

from __future__ import annotations

import threading
from collections import deque

from kv_offload.backends.base import TierChanges
from kv_offload.errors import TierRequestError

_STATE_SHARDS = 256  # a power of two


class ChangeFeed:
    """Coalesced per-key changes, taken in FIFO chunks. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Keys in the order of their first change not yet taken, and their latest state:
        # True (readable now) / False (not any more). A key changed again keeps its place in
        # the queue and gets the new state. A deque, and the states spread over small dicts,
        # rather than one ordered dict: growing a table of a million entries (a start-up
        # inventory not yet taken) would stall every thread for milliseconds to re-hash it.
        self._order: deque[bytes] = deque()
        self._states: list[dict[bytes, bool]] = [{} for _ in range(_STATE_SHARDS)]

    def __len__(self) -> int:
        """Keys whose change waits to be taken."""
        return len(self._order)

    def added(self, key: bytes) -> None:
        self._set(key, True)

    def removed(self, key: bytes) -> None:
        self._set(key, False)

    def extend(self, keys: list[bytes], readable: bool) -> None:
        """Record one state for several keys under one lock hold."""
        with self._lock:
            states, order = self._states, self._order
            for key in keys:
                state = states[hash(key) & (_STATE_SHARDS - 1)]
                if key not in state:
                    order.append(key)
                state[key] = readable

    def _set(self, key: bytes, readable: bool) -> None:
        with self._lock:
            state = self._states[hash(key) & (_STATE_SHARDS - 1)]
            if key not in state:
                self._order.append(key)
            state[key] = readable

    def take(self, max_keys: int) -> TierChanges:
        """The oldest pending changes, at most ``max_keys`` keys; they are gone from the feed."""
        if not isinstance(max_keys, int) or isinstance(max_keys, bool) or max_keys <= 0:
            raise TierRequestError(f"take_changes(max_keys={max_keys!r}): expected an int >= 1")
        with self._lock:
            order, states = self._order, self._states
            taken = [(key, states[hash(key) & (_STATE_SHARDS - 1)].pop(key))
                     for key in (order.popleft() for _ in range(min(max_keys, len(order))))]
        return TierChanges(
            added=tuple(key for key, readable in taken if readable),
            removed=tuple(key for key, readable in taken if not readable),
        )
