"""BucketKeys: the keys of one S3 prefix, split into this engine's and everyone else's.

A bucket prefix is shared by a fleet. Before, every engine adopted every object it listed into
its budgeted LRU index and evicted down to its own ``bytes_to_use``: one engine configured with
a small budget deleted the fleet's objects (40 -> 3 in a reproduction). Now the budget bounds
what this engine wrote, and only that is evicted by it:

- ``own``: a ``KeyIndex`` (the disk tier's: LRU, reservations, read pins) of the objects this
  engine stored, under ``bytes_to_use``; its victims are deleted by the tier.
- ``others``: a ``ServerKeys`` view (``kv_offload.backends.server_keys``) of objects other
  writers stored (or this engine before a restart: a listing cannot tell): readable, never
  evicted by this engine. What bounds them is the other engines' budgets, and for objects
  nobody owns any more (an engine that stopped or restarted) the bucket's own lifecycle rule
  (README).

``evict_others=True`` restores the single-owner behaviour: everything listed joins ``own``
and the whole prefix is kept within ``bytes_to_use`` (for a prefix no other engine uses).

Both record changes in one ``ChangeFeed`` (it has its own lock; the latest state of a key
wins), so ``take_changes`` sees one stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv_offload.backends.filesystem.changes import ChangeFeed
from kv_offload.backends.filesystem.index import KeyIndex, Reservation
from kv_offload.backends.filesystem.listing import ScanListing
from kv_offload.backends.server_keys import ServerKeys

_CHUNK = 1024  # keys per lock hold when sorting a listing into own and others'


@dataclass(frozen=True)
class ScanStart:
    """The generations of one listing, opened before the listing starts."""

    own: int
    others: int


@dataclass(frozen=True)
class ScanMerge:
    """What merging one listing changed."""

    added: int
    dropped: int


class BucketKeys:
    """This engine's objects (budgeted, evicted by it) and other writers' (see above)."""

    def __init__(self, budget_bytes: int, evict_others: bool = False) -> None:
        self.feed = ChangeFeed()
        self.own = KeyIndex(budget_bytes, self.feed)
        self.others = ServerKeys(self.feed)
        self.evict_others = evict_others

    def __len__(self) -> int:
        return len(self.own) + len(self.others)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        mine = self.own.contains(list(keys))
        theirs = self.others.contains(keys)
        return [a or b for a, b in zip(mine, theirs)]

    def present(self, key: bytes) -> bool:
        """Whether the key is stored (ours: counts as an access)."""
        return self.own.touch(key) or self.others.contains([key])[0]

    def keys(self) -> list[bytes]:
        return self.own.keys() + self.others.keys()

    def reserve(self, nbytes: int) -> Reservation | None:
        return self.own.reserve(nbytes)

    def release(self, reservation: Reservation) -> None:
        self.own.release(reservation)

    def commit(self, reservation: Reservation, key: bytes, size: int, sent: bool) -> list[bytes]:
        """A write landed: ``sent`` if this engine stored the object, not if it found one
        there already (someone else's: theirs, unless ``evict_others``). Returns the victims
        to delete now."""
        if sent or self.evict_others:
            self.others.discard([key])  # (before the add: the feed's latest state is "added")
            return self.own.commit(reservation, key, size)
        self.own.release(reservation)
        self.others.add([key])
        return []

    def begin_read(self, key: bytes) -> bool:
        """Whether the key is stored; ours are pinned against eviction until ``end_read``."""
        return self.own.begin_read(key) is not None or self.others.contains([key])[0]

    def end_read(self, key: bytes) -> None:
        self.own.end_read(key)

    def remove(self, key: bytes) -> None:
        self.own.remove(key)
        self.others.discard([key])

    def start_scan(self) -> ScanStart:
        return ScanStart(self.own.start_scan(), self.others.begin_scan())

    def merge_scan(self, listing: ScanListing, start: ScanStart) -> ScanMerge:
        """Merge a listing of the prefix (opened by ``start_scan`` before it was taken)."""
        if self.evict_others:
            merged = self.own.merge_scan(listing, start.own)
            return ScanMerge(merged.added, merged.dropped)
        files = list(listing.files())
        mine, theirs = ScanListing(), []
        for at in range(0, len(files), _CHUNK):
            chunk = files[at:at + _CHUNK]
            for f, held in zip(chunk, self.own.contains([f.key for f in chunk])):
                if held:
                    mine.add(f.key, f.size, f.mtime)
                else:
                    theirs.append(f.key)
        # (own: only drops ours that vanished, adopts nothing: every listed key is ours)
        dropped = self.own.merge_scan(mine, start.own).dropped
        added, gone = self.others.merge_scan(theirs, start.others)
        return ScanMerge(added, dropped + gone)

    def evict_to_budget(self) -> list[bytes]:
        return self.own.evict_to_budget()

    @property
    def used_bytes(self) -> int:
        """Bytes of this engine's objects (and writes in flight): what its budget bounds."""
        return self.own.used_bytes
