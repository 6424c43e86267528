"""ServerKeys: the keys a shared store (a Valkey server; other writers' S3 objects) is
believed to hold, kept in memory.

``lookup`` is on the scheduler's path every step and must never touch the network, so the tier
answers from this view. It is a hint, filled by our own writes and reads and corrected by a
bounded background SCAN: a key the server evicted stays in the view until a read misses on it
or the next scan, and a key another process wrote appears with the next scan. A read that
misses is a miss (the engine recomputes), never wrong bytes.

Scans are merged with a generation stamp, as the key index (``common.index``) does: SCAN returns
every key present for its whole duration, but a key added while it runs may be missing from
it, so only keys already in the view when the scan began are dropped when the scan did not
see them. A paced scan (the Valkey tier's crawl, a few pages per poll) stamps the keys it
sees with ``confirm`` and ends with ``drop_unseen``. Every change also goes to the view's
``ChangeFeed`` (``common.changes``), under the view's lock, so the feed and the view
never disagree.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from itertools import islice

from kv_offload.backends.base import TierChanges
from kv_offload.backends.common.changes import ChangeFeed
from kv_offload.backends.common.pacing import Pacer, Pause, let_others_run


class ServerKeys:
    """A thread-safe set of keys with scan generations and a change feed."""

    def __init__(self, feed: ChangeFeed | None = None) -> None:
        self._lock = threading.Lock()
        self._stamps: dict[bytes, int] = {}  # key -> generation it was last confirmed in
        self._generation = 0
        self._feed = feed if feed is not None else ChangeFeed()  # (shared: S3's BucketKeys)

    def __len__(self) -> int:
        return len(self._stamps)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._stamps for key in keys]

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._stamps)

    def add(self, keys: Iterable[bytes]) -> None:
        """Keys the server was just seen to hold (our write landed, a read found it)."""
        with self._lock:
            for key in keys:
                if key not in self._stamps:
                    self._stamps[key] = self._generation
                    self._feed.added(key)

    def discard(self, keys: Iterable[bytes]) -> None:
        """Keys the server was just seen not to hold (evicted, deleted, bad value dropped)."""
        with self._lock:
            for key in keys:
                if self._stamps.pop(key, None) is not None:
                    self._feed.removed(key)

    def clear(self) -> None:
        with self._lock:
            for key in self._stamps:
                self._feed.removed(key)
            self._stamps.clear()

    def begin_scan(self) -> int:
        """Open a scan generation; pass it to ``merge_scan`` with every key that scan saw."""
        with self._lock:
            self._generation += 1
            return self._generation

    def merge_scan(self, found: Iterable[bytes], generation: int) -> tuple[int, int]:
        """Adopt keys the scan saw; drop keys it did not see that predate it.
        Returns (keys added, keys dropped)."""
        seen = set(found)
        with self._lock:
            new = [k for k in seen if k not in self._stamps]
            gone = [k for k, stamp in self._stamps.items()
                    if stamp < generation and k not in seen]
            for key in seen:
                self._stamps[key] = generation
            for key in gone:
                del self._stamps[key]
                self._feed.removed(key)
            for key in new:
                self._feed.added(key)
        return len(new), len(gone)

    def confirm(self, keys: Iterable[bytes], generation: int) -> int:
        """Keys a paced scan of ``generation`` saw: adopted if new, and stamped so that the
        end of that scan (``drop_unseen``) keeps them. Returns the keys added."""
        added = 0
        with self._lock:
            for key in keys:
                stamp = self._stamps.get(key)
                if stamp is None:
                    self._feed.added(key)
                    added += 1
                if stamp is None or stamp < generation:
                    self._stamps[key] = generation
        return added

    def drop_unseen(self, seen: Callable[[bytes], bool], generation: int,
                    pause: Pause = let_others_run) -> int:
        """Drop the keys that predate scan ``generation`` and that it did not see (keys it
        saw were ``add``-ed page by page while it ran: S3's paced listing). In steps of
        ~0.25 ms, each one lock hold, after one snapshot of the keys (a C-speed copy: ~4 ms
        per million keys). Returns the keys dropped."""
        with self._lock:
            snapshot = iter(list(self._stamps))
        dropped = 0
        with Pacer(pause, self._lock) as pacer:
            while chunk := list(islice(snapshot, 256)):
                for key in chunk:
                    stamp = self._stamps.get(key)
                    if stamp is not None and stamp < generation and not seen(key):
                        del self._stamps[key]
                        self._feed.removed(key)
                        dropped += 1
                pacer.tick(len(chunk))
        return dropped

    def take_changes(self, max_keys: int) -> TierChanges:
        return self._feed.take(max_keys)
