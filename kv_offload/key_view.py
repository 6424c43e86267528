"""Where this process's tiers hold each key, and the changes not yet reported.

`TieredStore` feeds a `KeyView` with what it learns (host slots that became ready or were
evicted, keys the storage tier reports added or removed, its own write-throughs and failed
reads) and the connector drains it in bounded batches (`take`). Work is proportional to
what changed: a change marks its key dirty, and `take` looks only at dirty keys, comparing
each with what was last reported, so a key stored and evicted between two reports costs
nothing downstream.

Storage keys carry a generation: a connector reset starts a new one, so nothing stored
before it is served after it, without deleting a file (other engines may be reading them;
old generations age out under the storage tier's budget). Generation 0 is the one every
engine starts in, so engines sharing a directory, and restarts, share their keys.

Storage key layout: 8 bytes of generation, 2 bytes of group (little endian), the block
hash (int hashes as 32 bytes, little endian).
"""

from __future__ import annotations

import secrets

from kv_offload.types import KeyChange, KeyChanges, Location, OffloadKey

GENERATION_BYTES = 8
FIRST_GENERATION = bytes(GENERATION_BYTES)


def new_generation() -> bytes:
    """A fresh generation (random: engines that reset independently never collide)."""
    while (generation := secrets.token_bytes(GENERATION_BYTES)) == FIRST_GENERATION:
        pass
    return generation


def storage_key(key: OffloadKey, generation: bytes = FIRST_GENERATION) -> bytes:
    """The storage tier's opaque key for (block hash, group) in `generation`."""
    block_hash, group = key
    if isinstance(block_hash, int):
        block_hash = block_hash.to_bytes(32, "little", signed=block_hash < 0)
    return generation + group.to_bytes(2, "little") + bytes(block_hash)


def offload_key(key: bytes, generation: bytes = FIRST_GENERATION) -> OffloadKey | None:
    """The inverse of `storage_key` (hashes come back as bytes); None for a key of another
    generation or not ours."""
    if len(key) <= GENERATION_BYTES + 2 or not key.startswith(generation):
        return None
    group = int.from_bytes(key[GENERATION_BYTES:GENERATION_BYTES + 2], "little")
    return key[GENERATION_BYTES + 2:], group


class KeyView:
    """Host and storage membership of keys, with the changes since the last `take`.
    Driven by one thread at a time (the caller's lock)."""

    def __init__(self) -> None:
        self._host: set[OffloadKey] = set()
        self._storage: set[OffloadKey] = set()
        self._reported: dict[OffloadKey, Location] = {}
        self._dirty: dict[OffloadKey, None] = {}
        self._reset = False

    def location(self, key: OffloadKey) -> Location:
        if key in self._host:
            return Location.HOST
        return Location.STORAGE if key in self._storage else Location.ABSENT

    def in_storage(self, key: OffloadKey) -> bool:
        return key in self._storage

    def host_added(self, keys) -> None:
        self._update(self._host.add, keys)

    def host_removed(self, keys) -> None:
        self._update(self._host.discard, keys)

    def storage_added(self, keys) -> None:
        self._update(self._storage.add, keys)

    def storage_removed(self, keys) -> None:
        self._update(self._storage.discard, keys)

    def reset(self) -> None:
        """Forget everything; the next `take` tells the reader to forget too (O(1) here,
        and O(1) for the reader: no per-key removal is reported)."""
        self._host, self._storage = set(), set()
        self._reported, self._dirty = {}, {}
        self._reset = True

    def take(self, max_keys: int) -> KeyChanges:
        """Up to `max_keys` keys whose location differs from what was last reported."""
        changes = []
        dirty, reported = self._dirty, self._reported
        while dirty and len(changes) < max_keys:
            key, _ = dirty.popitem()
            now = self.location(key)
            if reported.get(key, Location.ABSENT) is now:
                continue
            changes.append(KeyChange(key, now))
            if now is Location.ABSENT:
                del reported[key]
            else:
                reported[key] = now
        batch = KeyChanges(tuple(changes), self._reset)
        self._reset = False
        return batch

    @property
    def num_pending(self) -> int:
        """Keys that may still have a change to report."""
        return len(self._dirty)

    def _update(self, op, keys) -> None:
        for key in keys:
            op(key)
            self._dirty[key] = None
