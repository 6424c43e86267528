"""ChangeFeed: what a tier's in-memory view gained and lost, handed out by `take_changes`.

A shared store changes under the engine: our own writes land, the server evicts, another
process writes or deletes, a bad value is dropped. The tier records each change here while it
updates its view (under the same lock, so the feed and the view never disagree); the caller
takes them in bounded chunks each step, in O(changes) — never a listing of the whole store.

Nothing is recorded until the first `take`: that call starts the feed from a snapshot of the
whole view (every key as added), so a tier whose feed nobody reads keeps no backlog. The
latest state of a key wins, and a key never appears both added and removed in one chunk.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from kv_offload.backends.base import TierChanges


class ChangeFeed:
    """Pending key changes, latest state per key, in the order they last changed.

    Not locked: the owning tier calls it under the lock that guards its view.
    """

    def __init__(self) -> None:
        self._pending: dict[bytes, bool] = {}  # key -> present now; insertion = change order
        self._started = False

    def added(self, keys: Iterable[bytes]) -> None:
        self._record(keys, True)

    def removed(self, keys: Iterable[bytes]) -> None:
        self._record(keys, False)

    def take(self, max_keys: int, snapshot: Callable[[], Iterable[bytes]]) -> TierChanges:
        """Up to ``max_keys`` changes, oldest first; the first call starts from ``snapshot()``
        (every key of the view)."""
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        if not self._started:
            self._started = True
            self._pending = dict.fromkeys(snapshot(), True)
        added: list[bytes] = []
        removed: list[bytes] = []
        for key in list(itertools.islice(self._pending, max_keys)):  # O(max_keys)
            (added if self._pending.pop(key) else removed).append(key)
        return TierChanges(tuple(added), tuple(removed))

    def __len__(self) -> int:
        return len(self._pending)

    def _record(self, keys: Iterable[bytes], present: bool) -> None:
        if not self._started:
            return
        for key in keys:
            self._pending.pop(key, None)  # re-insert: it moves to the end (latest change)
            self._pending[key] = present
