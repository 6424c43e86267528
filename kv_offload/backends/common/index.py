"""A tier's in-memory key index: which keys it stored, LRU order, byte budget.

The filesystem tier keeps one over its directory, the S3 tier one over the objects this engine
wrote (``s3.keys``): shared here, in ``backends.common``, so that neither tier imports the other.

Contents:
- `KeyIndex`: keys and file sizes in LRU order under a byte budget; write reservations, read
  pins, and directory-scan merges applied in bounded steps.
- `Reservation`: the room one write holds, and the keys it evicts once the write has landed.
- `KeyIndex.adopt`: keys a targeted look found (the filesystem tier's ``find``), adopted by
  the same code as a scan's, outside any scan.
(`ScanListing`, `ScannedFile` and `MergeResult`, the input and output of merges, are in
``listing``; ``let_others_run`` and `Pacer` in ``pacing``.)

No I/O here (files and objects are the tier's): lookups on the scheduler's hot path only take
a lock. The index decides what to evict and hands the victims back; the caller deletes their
files (off the hot path) and tolerates files that another process already deleted. Every
change of the key set is recorded in a `ChangeFeed` while the index lock is held, so the
feed's order matches the index's.

Order is a segmented LRU (`SegmentedLRU`): a new file enters probation; an access (a read, a
rewrite of the same key, or a lookup's hit reported through ``touch``) moves it to the
protected segment (at most ``PROTECTED_SHARE`` of the budget). Victims are probation's least
recent keys first. A key being read (``begin_read`` .. ``end_read``) is pinned and never
chosen for eviction.

Writes evict only after they land. ``reserve`` picks the least recent unpinned keys worth the
room a write needs and marks them doomed: they stay in the index and on disk (lookups and reads
still find them), but their bytes no longer count against other reservations. ``commit`` (the
file landed) removes the victims that are still doomed and hands them back for deletion;
``release`` (the write failed, e.g. the disk is full) un-dooms them: a failed write costs
nothing but itself. A doomed key that is read or rewritten meanwhile is rescued (it is recent
again) and survives; the budget is then over by its size until the next eviction.

Scan merges and evictions never hold the lock for long. A rescan used to diff the listing
against the index in one lock hold (1.5 s at 500k keys, 3.3 s at 1M on a 2-core host). Now
the merge visits the LRU's shards (~1/4096 of the keys each) with a `Pacer`: every ~0.25 ms of
work it releases the lock and pauses, so that a waiting caller gets the lock and the
interpreter lock (GIL). New keys are adopted the same way, oldest mtime first. Whatever may
have changed during a pause is checked again after it; two sets cover the rest: a key
committed after the scan started may be missing from its listing, so it is not dropped; a key
this process removed while the scan ran is not adopted from the listing (its file was listed
before it was deleted).
"""

from __future__ import annotations

import heapq
import threading
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice

from kv_offload.backends.common.changes import ChangeFeed
from kv_offload.backends.common.listing import MergeResult, ScanListing, ScannedFile
from kv_offload.backends.common.lru import SegmentedLRU
from kv_offload.backends.common.pacing import Pacer, Pause, let_others_run

_RUN = 1024  # new keys are sorted in runs of this many (~0.2 ms each), merged lazily
PROTECTED_SHARE = 0.8  # of the budget: keys that served a hit


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
        self._lru = SegmentedLRU(int(budget_bytes * PROTECTED_SHARE))
        self._readers: dict[bytes, int] = {}  # pinned keys -> reads in progress
        self._doomed: set[bytes] = set()  # victims of writes in flight
        self._committed = 0  # bytes of files on disk (doomed ones included)
        self._doomed_bytes = 0
        self._reserved = 0  # bytes of writes in flight
        self._generation = 0
        self._fresh: set[bytes] | None = None  # committed since the open scan started
        self._removed: set[bytes] | None = None  # removed since the open scan started

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def used_bytes(self) -> int:
        """Bytes of files on disk plus bytes reserved by writes in flight."""
        return self._committed + self._reserved

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget (this tier's share of the root); ``evict_to_budget`` applies it."""
        with self._lock:
            self.budget_bytes = max(0, budget_bytes)
            self._lru.protected_limit = int(self.budget_bytes * PROTECTED_SHARE)

    def contains(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is stored (does not count as an access)."""
        with self._lock:
            return self._lru.contains_each(keys)

    def keys(self) -> list[bytes]:
        """Every stored key (a snapshot, O(keys), in no particular order: tools and tests)."""
        with self._lock:
            return self._lru.keys()

    def touch(self, key: bytes) -> bool:
        """Mark a stored key as just accessed (protected); False if it is not stored."""
        with self._lock:
            return self._access(key)

    def touch_each(self, keys: Iterable[bytes]) -> None:
        """`touch` every stored key of ``keys``, in order, in one lock hold."""
        with self._lock:
            for key in keys:
                self._access(key)

    # -- writes: reserve, then commit or release ------------------------------------------

    def reserve(self, nbytes: int) -> Reservation | None:
        """Hold room for a new file of ``nbytes``, dooming least recent keys if needed.

        None when the file cannot fit even after evicting every unpinned key (nothing changes).
        """
        with self._lock:
            victims = self._pick_victims(self._excess() + nbytes, all_or_nothing=True)
            if victims is None:
                return None
            for key in victims:
                self._doomed.add(key)
                self._doomed_bytes += self._lru.size(key)
            self._reserved += nbytes
            return Reservation(nbytes, tuple(victims))

    def commit(self, reservation: Reservation, key: bytes, size: int) -> list[bytes]:
        """The reserved write landed: ``key`` is on disk with ``size`` bytes, most recent.

        Returns the victims to delete now (those still doomed; rescued ones stay).
        """
        with self._lock:
            self._reserved -= reservation.nbytes
            self._undoom(key)
            self._committed += size - (self._lru.put(key, size) or 0)
            if self._fresh is not None:
                self._fresh.add(key)
            self.feed.added(key)
            gone = [victim for victim in reservation.victims if victim in self._doomed]
            for victim in gone:
                self._drop(victim)
            return gone

    def release(self, reservation: Reservation) -> None:
        """The reserved write failed: give the room back and keep its victims."""
        with self._lock:
            self._reserved -= reservation.nbytes
            for victim in reservation.victims:
                self._undoom(victim)

    def evict_to_budget(self, pause: Pause = let_others_run) -> list[bytes]:
        """Evict unpinned LRU keys until the budget holds, in short steps; returns them for
        deletion."""
        gone: list[bytes] = []
        pacer = Pacer(pause)
        while True:
            with self._lock:
                pacer.restart()
                victims = self._pick_victims(self._excess(), all_or_nothing=False, pacer=pacer)
                for key in victims:
                    self._drop(key)
            gone += victims
            if not victims or self._excess() <= 0:
                return gone
            if pause is not None:
                pause()

    # -- reads ------------------------------------------------------------------------------

    def begin_read(self, key: bytes) -> int | None:
        """Pin ``key`` for a read and count it as an access; its file size, or None if absent."""
        with self._lock:
            if not self._access(key):
                return None
            self._readers[key] = self._readers.get(key, 0) + 1
            return self._lru.size(key)

    def end_read(self, key: bytes) -> None:
        """Unpin a key after its read (it may have been removed meanwhile)."""
        with self._lock:
            readers = self._readers.get(key, 0)
            if readers > 1:
                self._readers[key] = readers - 1
            else:
                self._readers.pop(key, None)

    def remove(self, key: bytes) -> bool:
        """Forget a key (its file is bad or gone); False if it was not there."""
        with self._lock:
            if key not in self._lru:
                return False
            self._drop(key)
            return True

    # -- scans ------------------------------------------------------------------------------

    def start_scan(self) -> int:
        """Open a scan (one at a time); pass the generation to ``merge_scan`` with its files."""
        with self._lock:
            self._generation += 1
            self._fresh, self._removed = set(), set()
            return self._generation

    def merge_scan(
        self,
        listing: ScanListing | Iterable[ScannedFile],
        generation: int,
        pause: Pause = let_others_run,
    ) -> MergeResult:
        """Adopt newly found keys (oldest mtime least recent), update sizes, drop vanished keys.

        Runs in steps of ~0.25 ms, each one lock hold, with ``pause()`` between steps (None: no
        pauses, for the first scan, before anyone can call the tier).
        """
        if generation != self._generation or self._fresh is None:
            raise ValueError(f"scan {generation} is not open; call start_scan() first")
        if not isinstance(listing, ScanListing):
            listing = ScanListing.of(listing)
        new_keys, new_rows, dropped, resized = self._diff_shards(listing, pause)
        added = self._adopt(listing, new_keys, new_rows, pause)
        with self._lock:
            self._fresh = self._removed = None
        return MergeResult(added, dropped, resized)

    def merge_changes(
        self,
        added: ScanListing,
        vanished: Iterable[bytes],
        generation: int,
        pause: Pause = let_others_run,
    ) -> MergeResult:
        """Apply what an incremental scan found (``fanout_scan``): adopt the keys that
        appeared (oldest mtime least recent), drop the keys whose files vanished. Same rules
        as ``merge_scan`` (a key committed or being read since the scan started is kept, a
        key removed since is not adopted), at a cost in the keys changed, not the keys held.
        """
        if generation != self._generation or self._fresh is None:
            raise ValueError(f"scan {generation} is not open; call start_scan() first")
        dropped = 0
        with Pacer(pause, self._lock) as pacer:
            for key in vanished:
                if key in self._lru and key not in self._fresh and key not in self._readers:
                    self._drop(key)  # deleted by another process
                    dropped += 1
                pacer.tick()
        adopted = self._adopt(added, *_columns(added), pause)
        with self._lock:
            self._fresh = self._removed = None
        return MergeResult(adopted, dropped)

    def adopt(self, found: ScanListing) -> int:
        """Adopt keys found outside a scan (``FilesystemTier.find``: a look at a few named
        files), by a scan's rules: oldest mtime least recent, a key held already unchanged,
        a key this process removed since an open scan started not adopted. One lock hold
        (a few hundred keys at most). A scan open meanwhile keeps them, as it keeps keys
        committed since it started (its listing may predate their files). Returns the keys
        adopted."""
        return self._adopt(found, *_columns(found), None)

    def _diff_shards(
        self, listing: ScanListing, pause: Pause
    ) -> tuple[list[bytes], array, int, int]:
        new_keys: list[bytes] = []
        new_rows = array("q")
        dropped = resized = 0
        sizes, lru = listing.sizes, self._lru
        with Pacer(pause, self._lock) as pacer:
            for index, listed in enumerate(listing.shards):
                shard = lru.shard_keys(index)
                if not shard and not listed:
                    continue
                for key in shard - listed.keys():
                    # Checked per key: a pause may have come between the difference and now.
                    if key in lru and key not in self._fresh and key not in self._readers:
                        self._drop(key)  # deleted by another process
                        dropped += 1
                    pacer.tick()
                common = shard & listed.keys()
                held = lru.sizes_in_shard(index, common)  # (a set iterates the same way twice)
                seen = [sizes[listed[key]] for key in common]
                if held != seen:  # rewritten elsewhere with another size: rare
                    for key, size in zip(common, seen):
                        if lru.size(key) not in (None, size):
                            self._resize(key, size)
                            resized += 1
                for key in listed.keys() - shard:
                    new_keys.append(key)
                    new_rows.append(listed[key])
                pacer.tick(len(listed) // 4 + 1)  # set operations and comparisons
        return new_keys, new_rows, dropped, resized

    def _adopt(self, listing: ScanListing, keys: list[bytes], rows: array, pause: Pause) -> int:
        """Insert the new keys, oldest mtime first (the least recent), in paced steps."""
        order = self._by_age(listing, rows, pause)
        sizes, lru = listing.sizes, self._lru
        added = 0
        with Pacer(pause, self._lock) as pacer:
            while step := list(islice(order, 64)):
                # (read in the lock hold: `adopt` runs outside scans, which open and close
                # these sets; within a scan's merge they stay the same)
                removed, fresh = self._removed or (), self._fresh
                adopted = []
                for i in step:
                    key, size = keys[i], sizes[rows[i]]
                    if key not in removed and lru.add(key, size):
                        adopted.append(key)
                        self._committed += size
                if fresh is not None:  # a scan is open: its listing may not have these
                    fresh.update(adopted)  # (a scan's own: dropping came first, harmless)
                self.feed.extend(adopted, True)  # (before the pacer may pause: same order)
                added += len(adopted)
                pacer.tick(len(step))
        return added

    @staticmethod
    def _by_age(listing: ScanListing, rows: array, pause: Pause) -> Iterator[int]:
        """Positions in ``rows`` from the oldest mtime to the newest, without holding the GIL
        for long: a long sort is done in short runs, merged lazily while adopting."""
        mtimes = array("d")
        with Pacer(pause) as pacer:
            for start in range(0, len(rows), _RUN):
                mtimes.extend(listing.mtimes[row] for row in rows[start : start + _RUN])
                pacer.tick(_RUN)
            by_age = mtimes.__getitem__
            if pause is None or len(rows) <= _RUN:
                return iter(sorted(range(len(rows)), key=by_age))
            runs = []
            for start in range(0, len(rows), _RUN):
                runs.append(sorted(range(start, min(start + _RUN, len(rows))), key=by_age))
                pacer.tick(_RUN)
        return heapq.merge(*runs, key=by_age)

    # -- internals (lock held) -------------------------------------------------------------

    def _excess(self) -> int:
        return self._committed - self._doomed_bytes + self._reserved - self.budget_bytes

    def _access(self, key: bytes) -> bool:
        if not self._lru.touch(key):
            return False
        self._undoom(key)  # an accessed key is recent: not worth evicting any more
        return True

    def _undoom(self, key: bytes) -> None:
        if key in self._doomed:
            self._doomed.discard(key)
            self._doomed_bytes -= self._lru.size(key)

    def _resize(self, key: bytes, size: int) -> None:
        old = self._lru.size(key)
        self._undoom(key)
        self._lru.set_size(key, size)
        self._committed += size - old

    def _drop(self, key: bytes) -> None:
        """Forget ``key`` and record it in the feed (in the same lock hold: same order)."""
        self._undoom(key)
        self._committed -= self._lru.pop(key)
        if self._removed is not None:
            self._removed.add(key)
        self.feed.removed(key)

    def _pick_victims(
        self, excess: int, *, all_or_nothing: bool, pacer: Pacer | None = None
    ) -> list[bytes] | None:
        """Least recent keys that are neither pinned nor doomed, worth ``excess`` bytes; with
        a ``pacer``, only as many as its step has time for."""
        victims: list[bytes] = []
        if excess <= 0:
            return victims
        skip = self._readers.__contains__ if not self._doomed else self._pinned_or_doomed
        walk = self._lru.oldest(skip)
        try:
            for key, size in walk:
                victims.append(key)
                excess -= size
                if excess <= 0 or (pacer is not None and len(victims) % 16 == 0 and pacer.over()):
                    break
        finally:
            walk.close()
        if excess > 0 and all_or_nothing:
            return None
        return victims

    def _pinned_or_doomed(self, key: bytes) -> bool:
        return key in self._readers or key in self._doomed


def _columns(listing: ScanListing) -> tuple[list[bytes], array]:
    """A listing's keys and their rows, in one order (what `_adopt` takes)."""
    keys: list[bytes] = []
    rows = array("q")
    for shard in listing.shards:
        keys.extend(shard.keys())
        rows.extend(shard.values())
    return keys, rows
