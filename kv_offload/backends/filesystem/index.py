"""The in-memory index of the filesystem tier: which keys are on disk, LRU order, byte budget.

Contents:
- `KeyIndex`: keys and file sizes in LRU order under a byte budget; write reservations, read
  pins, and directory-scan merges applied in bounded steps.
- `Reservation`: the room one write holds, and the keys it evicts once the write has landed.
- `ScannedFile`, `MergeResult`: one file of a directory listing; what a merge changed.

No I/O here: lookups on the scheduler's hot path only take a lock. The index decides what to
evict and hands the victims back; the caller deletes their files (off the hot path) and
tolerates files that another process already deleted. Every change of the key set is recorded
in a `ChangeFeed` while the index lock is held, so the feed's order matches the index's.

Recency is "last access": a write or a read moves a key to the most recent end. A key being
read (``begin_read`` .. ``end_read``) is pinned and never chosen for eviction.

Writes evict only after they land. ``reserve`` picks the least recent unpinned keys worth the
room a write needs and marks them doomed: they stay in the index and on disk (lookups and reads
still find them), but their bytes no longer count against other reservations. ``commit`` (the
file landed) removes the victims that are still doomed and hands them back for deletion;
``release`` (the write failed, e.g. the disk is full) un-dooms them: a failed write costs
nothing but itself. A doomed key that is read or rewritten meanwhile is rescued (it is recent
again) and survives; the budget is then over by its size until the next eviction.

Scan merges never hold the lock for long. A rescan of a million keys used to diff the listing
against the index in one lock hold (~2 s); now keys are spread over ``NUM_BUCKETS`` sets by
their hash, and the merge visits the buckets in steps of about ``STEP_KEYS`` keys, each under
one short lock hold (C set differences of ~1k keys), calling ``pause`` between steps so that a
waiting caller gets the lock and the interpreter (the GIL) in between. New keys are adopted in
steps too, oldest mtime first. Correctness across the gaps between steps comes from two
stamps: an entry committed after the scan started (``start_scan``) may be missing from that
scan's listing, so only entries older than the scan are dropped; and a key this process
removed while the scan was open is not adopted from the listing (its file was listed before
it was deleted).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from kv_offload.backends.filesystem.changes import ChangeFeed

NUM_BUCKETS = 1024  # a power of two: bucket = hash(key) & (NUM_BUCKETS - 1)
STEP_KEYS = 2048  # keys handled per lock hold in merges and evictions (~0.2-0.5 ms)
SORT_AT_ONCE = 16384  # fewer new keys than this are sorted in one call (< ~5 ms)


def let_others_run() -> None:
    """The default pause between merge steps: release the GIL long enough for a waiter."""
    time.sleep(0.0001)


Pause = Callable[[], None] | None
_MTIME = attrgetter("mtime")


@dataclass
class _Entry:
    size: int
    stamp: int
    readers: int = 0
    doomed: bool = False


@dataclass(frozen=True)
class ScannedFile:
    """One final file found by a directory scan."""

    key: bytes
    size: int
    mtime: float


@dataclass(frozen=True)
class MergeResult:
    """What merging one scan changed in the index."""

    added: int = 0
    dropped: int = 0
    resized: int = 0


@dataclass(frozen=True)
class Reservation:
    """Room held for one write; ``victims`` are deleted once it lands, kept if it fails."""

    nbytes: int
    victims: tuple[bytes, ...] = ()


class KeyIndex:
    """Keys on disk with their file sizes, in LRU order, under a byte budget. Thread-safe."""

    def __init__(self, budget_bytes: int, feed: ChangeFeed | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.feed = feed if feed is not None else ChangeFeed()
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recent first
        self._buckets: list[set[bytes]] = [set() for _ in range(NUM_BUCKETS)]
        self._committed = 0  # bytes of files on disk (doomed ones included)
        self._doomed = 0  # bytes of doomed files (deleted once their evictor lands)
        self._reserved = 0  # bytes of writes in flight
        self._generation = 0
        self._removed_while_scanning: set[bytes] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        """Bytes of files on disk plus bytes reserved by writes in flight."""
        return self._committed + self._reserved

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget (the root-wide share of this tier); ``evict_to_budget`` applies it."""
        with self._lock:
            self.budget_bytes = max(0, budget_bytes)

    def contains(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is stored (does not count as an access)."""
        with self._lock:
            return [key in self._entries for key in keys]

    def keys(self) -> list[bytes]:
        """Every stored key (a snapshot, O(keys): for tools and tests)."""
        with self._lock:
            return list(self._entries)

    def touch(self, key: bytes) -> bool:
        """Mark a stored key as just accessed; False if it is not stored."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            self._access(key, entry)
            return True

    # -- writes: reserve, then commit or release ------------------------------------------

    def reserve(self, nbytes: int) -> Reservation | None:
        """Hold room for a new file of ``nbytes``, dooming least recent keys if needed.

        None when the file cannot fit even after evicting every unpinned key (nothing changes).
        """
        with self._lock:
            excess = self._committed - self._doomed + self._reserved + nbytes - self.budget_bytes
            victims = self._pick_victims(excess, all_or_nothing=True)
            if victims is None:
                return None
            for key in victims:
                entry = self._entries[key]
                entry.doomed = True
                self._doomed += entry.size
            self._reserved += nbytes
            return Reservation(nbytes, tuple(victims))

    def commit(self, reservation: Reservation, key: bytes, size: int) -> list[bytes]:
        """The reserved write landed: ``key`` is on disk with ``size`` bytes, most recent.

        Returns the victims to delete now (those still doomed; rescued ones stay).
        """
        with self._lock:
            self._reserved -= reservation.nbytes
            entry = self._entries.get(key)
            if entry is None:
                self._insert(key, _Entry(size, self._generation))
            else:
                self._undoom(entry)
                self._committed += size - entry.size
                entry.size, entry.stamp = size, self._generation
                self._entries.move_to_end(key)
            self.feed.added(key)
            gone = []
            for victim in reservation.victims:
                doomed = self._entries.get(victim)
                if doomed is not None and doomed.doomed:
                    self._drop(victim)
                    gone.append(victim)
            return gone

    def release(self, reservation: Reservation) -> None:
        """The reserved write failed: give the room back and keep its victims."""
        with self._lock:
            self._reserved -= reservation.nbytes
            for victim in reservation.victims:
                entry = self._entries.get(victim)
                if entry is not None:
                    self._undoom(entry)

    def evict_to_budget(self, pause: Pause = let_others_run) -> list[bytes]:
        """Evict unpinned LRU keys until the budget holds, in steps; returns them for deletion."""
        gone: list[bytes] = []
        while True:
            with self._lock:
                excess = self._committed - self._doomed + self._reserved - self.budget_bytes
                victims = self._pick_victims(excess, all_or_nothing=False, limit=STEP_KEYS)
                for key in victims:
                    self._drop(key)
            gone += victims
            if len(victims) < STEP_KEYS:
                return gone
            if pause is not None:
                pause()

    # -- reads ------------------------------------------------------------------------------

    def begin_read(self, key: bytes) -> int | None:
        """Pin ``key`` for a read and count it as an access; its file size, or None if absent."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            entry.readers += 1
            self._access(key, entry)
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
            if key not in self._entries:
                return False
            self._drop(key)
            return True

    # -- scans ------------------------------------------------------------------------------

    def start_scan(self) -> int:
        """Open a scan generation; pass it to ``merge_scan`` with that scan's files."""
        with self._lock:
            self._generation += 1
            self._removed_while_scanning = set()
            return self._generation

    def merge_scan(
        self, files: Sequence[ScannedFile], generation: int, pause: Pause = let_others_run
    ) -> MergeResult:
        """Adopt newly found keys (oldest mtime least recent), update sizes, drop vanished keys.

        Runs in steps of about ``STEP_KEYS`` keys, each one short lock hold, with ``pause()``
        between steps (None: no pauses, for the first scan, before anyone can call the tier).
        """
        listed = self._group_by_bucket(files, pause)
        new, dropped, resized = self._diff_buckets(listed, generation, pause)
        added = self._adopt(new, generation, pause)
        with self._lock:
            self._removed_while_scanning = None
        return MergeResult(added, dropped, resized)

    def _group_by_bucket(
        self, files: Sequence[ScannedFile], pause: Pause
    ) -> list[dict[bytes, ScannedFile]]:
        listed: list[dict[bytes, ScannedFile]] = [{} for _ in range(NUM_BUCKETS)]
        mask = NUM_BUCKETS - 1
        for start in range(0, len(files), 4 * STEP_KEYS):
            for f in files[start : start + 4 * STEP_KEYS]:
                listed[hash(f.key) & mask][f.key] = f
            if pause is not None:
                pause()
        return listed

    def _diff_buckets(
        self, listed: list[dict[bytes, ScannedFile]], generation: int, pause: Pause
    ) -> tuple[list[ScannedFile], int, int]:
        new: list[ScannedFile] = []
        dropped = resized = work = 0
        self._lock.acquire()
        try:
            for bucket, found in zip(self._buckets, listed):
                if not bucket and not found:
                    continue
                for key in bucket - found.keys():
                    entry = self._entries[key]
                    if entry.stamp < generation and entry.readers == 0:
                        self._drop(key)  # deleted by another process
                        dropped += 1
                for key in bucket & found.keys():
                    entry, size = self._entries[key], found[key].size
                    if entry.size != size:  # rewritten elsewhere with another size
                        self._committed += size - entry.size
                        if entry.doomed:
                            self._doomed += size - entry.size
                        entry.size = size
                        resized += 1
                new += [found[key] for key in found.keys() - bucket]
                work += len(bucket) + len(found)
                if work >= STEP_KEYS and pause is not None:
                    self._lock.release()
                    pause()
                    self._lock.acquire()
                    work = 0
        finally:
            self._lock.release()
        return new, dropped, resized

    def _adopt(self, new: list[ScannedFile], generation: int, pause: Pause) -> int:
        if pause is None or len(new) <= SORT_AT_ONCE:
            ordered = iter(sorted(new, key=_MTIME))
        else:  # one long sort would hold the GIL: sort in small runs, merge them lazily
            runs = [
                sorted(new[i : i + STEP_KEYS], key=_MTIME) for i in range(0, len(new), STEP_KEYS)
            ]
            ordered = heapq.merge(*runs, key=_MTIME)
        added = 0
        while True:
            step = [f for _, f in zip(range(STEP_KEYS), ordered)]
            with self._lock:
                removed = self._removed_while_scanning or ()
                for f in step:
                    if f.key not in self._entries and f.key not in removed:
                        self._insert(f.key, _Entry(f.size, generation))
                        self.feed.added(f.key)
                        added += 1
            if len(step) < STEP_KEYS:
                return added
            if pause is not None:
                pause()

    # -- internals (lock held) -------------------------------------------------------------

    def _access(self, key: bytes, entry: _Entry) -> None:
        self._undoom(entry)  # an accessed key is recent: not worth evicting any more
        self._entries.move_to_end(key)

    def _undoom(self, entry: _Entry) -> None:
        if entry.doomed:
            entry.doomed = False
            self._doomed -= entry.size

    def _insert(self, key: bytes, entry: _Entry) -> None:
        self._entries[key] = entry
        self._buckets[hash(key) & (NUM_BUCKETS - 1)].add(key)
        self._committed += entry.size

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self._buckets[hash(key) & (NUM_BUCKETS - 1)].discard(key)
        self._committed -= entry.size
        if entry.doomed:
            self._doomed -= entry.size
        if self._removed_while_scanning is not None:
            self._removed_while_scanning.add(key)
        self.feed.removed(key)

    def _pick_victims(
        self, excess: int, *, all_or_nothing: bool, limit: int | None = None
    ) -> list[bytes] | None:
        """Least recent keys that are neither pinned nor doomed, worth ``excess`` bytes."""
        victims: list[bytes] = []
        for key, entry in self._entries.items():
            if excess <= 0 or len(victims) == limit:
                break
            if entry.readers == 0 and not entry.doomed:
                victims.append(key)
                excess -= entry.size
        if excess > 0 and all_or_nothing:
            return None
        return victims
