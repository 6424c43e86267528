"""BucketKeys: the keys of one S3 prefix, split into this engine's and everyone else's.

A bucket prefix is shared by a fleet. Before, every engine adopted every object it listed into
its budgeted LRU index and evicted down to its own ``bytes_to_use``: one engine configured with
a small budget deleted the fleet's objects (40 -> 3 in a reproduction). Now the budget bounds
what this engine wrote, and only that is evicted by it:

- ``own``: a ``KeyIndex`` (``kv_offload.backends.common.index``, as the disk tier's: LRU,
  reservations, read pins) of the objects this engine stored, under ``bytes_to_use``; its
  victims are deleted by the tier.
- ``others``: a ``ServerKeys`` view (``kv_offload.backends.common.server_keys``) of objects other
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

from kv_offload.backends.common.changes import ChangeFeed
from kv_offload.backends.common.index import KeyIndex, Reservation
from kv_offload.backends.common.listing import ScanListing
from kv_offload.backends.common.lru import ShardedLRU
from kv_offload.backends.common.pacing import Pause, let_others_run
from kv_offload.backends.common.server_keys import ServerKeys

_CHUNK = 1024  # keys per lock hold when sorting a page of a listing into own and others'


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

    def touch(self, keys: Sequence[bytes]) -> None:
        """Keys of a hit: this engine's own objects among them are protected (`KeyIndex`)."""
        self.own.touch_each(keys)

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

    def adopt_listed(self, keys: Sequence[bytes]) -> int:
        """Keys one page of a listing found: other writers' become readable now (ours are
        known already). With ``evict_others`` they join the budgeted index only when the
        listing ends (``finish_listing``). Returns the keys new to this engine."""
        if self.evict_others:
            return 0
        before = len(self.others)
        for at in range(0, len(keys), _CHUNK):
            chunk = list(keys[at:at + _CHUNK])
            self.others.add([k for k, held in zip(chunk, self.own.contains(chunk)) if not held])
        return len(self.others) - before

    def adopt_found(self, found: ScanListing) -> int:
        """Objects a targeted look found (``S3Tier.find``): adopted as a listing adopts
        them, i.e. other writers' (readable, never evicted by this engine) unless this
        engine holds them already; with ``evict_others``, into the budgeted index at once
        (``KeyIndex.adopt``: a listing would adopt them there at its end). Returns the keys
        new to this engine."""
        if self.evict_others:
            return self.own.adopt(found)
        keys = [f.key for f in found.files()]
        before = len(self.others)
        self.others.add([k for k, held in zip(keys, self.own.contains(keys)) if not held])
        return len(self.others) - before

    def finish_listing(self, listing: ScanListing, start: ScanStart,
                       pause: Pause = let_others_run) -> ScanMerge:
        """A listing of the whole prefix (opened by ``start_scan`` before its first page,
        its pages ``adopt_listed`` as they came) is complete: drop the keys that predate it
        and that it did not see, in paced steps (never one long lock hold)."""
        if self.evict_others:
            merged = self.own.merge_scan(listing, start.own, pause)
            return ScanMerge(merged.added, merged.dropped)

        def listed(key: bytes) -> bool:
            return key in listing.shards[ShardedLRU.shard_of(key)]

        # (own: bounded by this engine's budget; only drops, ours vanished from the store)
        ours = self.own.keys()  # (a snapshot)
        vanished = [key for key in ours if not listed(key)]
        dropped = self.own.merge_changes(ScanListing(), vanished, start.own, pause).dropped
        gone = self.others.drop_unseen(listed, start.others, pause)
        return ScanMerge(0, dropped + gone)

    def evict_to_budget(self) -> list[bytes]:
        return self.own.evict_to_budget()

    @property
    def used_bytes(self) -> int:
        """Bytes of this engine's objects (and writes in flight): what its budget bounds."""
        return self.own.used_bytes
