"""The in-memory index of the filesystem tier: which keys are on disk, LRU order, byte budget.

No I/O here: lookups on the scheduler's hot path only take a lock. The index decides what to
evict and hands the victims back; the caller deletes their files (off the hot path) and
tolerates files that another process already deleted.

Recency is "last access": a write or a read moves a key to the most recent end. A key being
read (``begin_read`` .. ``end_read``) is pinned and never chosen for eviction.

Directory scans (at start and periodically, to see other processes' files) are merged with a
generation stamp: an entry committed after a scan started may be missing from that scan's
listing, so only entries older than the scan are dropped when their file is gone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Entry:
    size: int
    stamp: int
    readers: int = 0


@dataclass(frozen=True)
class ScannedFile:
    """One final file found by a directory scan."""

    key: bytes
    size: int
    mtime: float


class KeyIndex:
    """Keys on disk with their file sizes, in LRU order, under a byte budget. Thread-safe."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recent first
        self._committed = 0
        self._reserved = 0
        self._generation = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        """Bytes of files on disk plus bytes reserved by writes in flight."""
        return self._committed + self._reserved

    def contains(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is stored (does not count as an access)."""
        with self._lock:
            return [key in self._entries for key in keys]

    def keys(self) -> list[bytes]:
        """Every stored key (a snapshot)."""
        with self._lock:
            return list(self._entries)

    def touch(self, key: bytes) -> bool:
        """Mark a stored key as just accessed; False if it is not stored."""
        with self._lock:
            if key not in self._entries:
                return False
            self._entries.move_to_end(key)
            return True

    def reserve(self, nbytes: int) -> list[bytes] | None:
        """Make room for a new file of ``nbytes``.

        Returns the evicted keys (already out of the index; their files are the caller's to
        delete), or None when the file cannot fit even after evicting every unpinned key.
        """
        with self._lock:
            excess = self._committed + self._reserved + nbytes - self.budget_bytes
            victims = self._pick_victims(excess, all_or_nothing=True)
            if victims is None:
                return None
            self._reserved += nbytes
            return victims

    def evict_to_budget(self) -> list[bytes]:
        """Evict unpinned LRU keys until the budget holds (e.g. after a scan found more)."""
        with self._lock:
            excess = self._committed + self._reserved - self.budget_bytes
            return self._pick_victims(excess, all_or_nothing=False) or []

    def _pick_victims(self, excess: int, *, all_or_nothing: bool) -> list[bytes] | None:
        """Pop least recent unpinned keys worth ``excess`` bytes (lock held)."""
        victims = []
        for key, entry in self._entries.items():
            if excess <= 0:
                break
            if entry.readers == 0:
                victims.append(key)
                excess -= entry.size
        if excess > 0 and all_or_nothing:
            return None
        for key in victims:
            self._committed -= self._entries.pop(key).size
        return victims

    def release(self, nbytes: int) -> None:
        """Give back a reservation whose write failed."""
        with self._lock:
            self._reserved -= nbytes

    def commit(self, key: bytes, reserved: int, size: int) -> None:
        """A reserved write landed: ``key`` is on disk with ``size`` bytes, most recent."""
        with self._lock:
            self._reserved -= reserved
            entry = self._entries.get(key)
            if entry is None:
                self._entries[key] = _Entry(size, self._generation)
            else:
                self._committed -= entry.size
                entry.size, entry.stamp = size, self._generation
                self._entries.move_to_end(key)
            self._committed += size

    def begin_read(self, key: bytes) -> int | None:
        """Pin ``key`` for a read and count it as an access; its file size, or None if absent."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            entry.readers += 1
            self._entries.move_to_end(key)
            return entry.size

    def end_read(self, key: bytes) -> None:
        """Unpin a key after its read (it may have been removed meanwhile)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.readers > 0:
                entry.readers -= 1

    def remove(self, key: bytes) -> bool:
        """Forget a key (its file is bad or gone); False if it was not there."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._committed -= entry.size
            return True

    def start_scan(self) -> int:
        """Open a scan generation; pass it to ``merge_scan`` with that scan's files."""
        with self._lock:
            self._generation += 1
            return self._generation

    def merge_scan(self, files: list[ScannedFile], generation: int) -> tuple[int, int]:
        """Add newly found keys (oldest mtime least recent), update sizes, drop vanished keys.

        Returns (keys added, keys dropped).
        """
        found = {f.key: f for f in files}
        added = dropped = 0
        with self._lock:
            for key, entry in list(self._entries.items()):
                seen = found.get(key)
                if seen is not None:
                    self._committed += seen.size - entry.size
                    entry.size = seen.size
                elif entry.stamp < generation and entry.readers == 0:
                    self._committed -= self._entries.pop(key).size
                    dropped += 1
            for f in sorted(files, key=lambda f: f.mtime):
                if f.key not in self._entries:
                    self._entries[f.key] = _Entry(f.size, generation)
                    self._committed += f.size
                    added += 1
        return added, dropped
