"""Where this process's tiers hold each key, and the changes not yet reported.

`TieredStore` feeds a `KeyView` with what it learns (host slots that became ready or were
evicted, keys the storage tier reports added or removed, its own write-throughs and failed
reads) and the connector drains it in bounded batches (`take`). Work is proportional to
what changed: a change marks its key dirty, and `take` looks only at dirty keys, comparing
each with what was last reported, so a key stored and evicted between two reports costs
nothing downstream.

Storage keys carry a generation: a connector reset starts a new one, so nothing stored
before it is served after it, without deleting a file (other engines may be reading them;
old generations age out under the storage tier's budget). The storage tier keeps the
generation in force (`kv_offload.store.generations`): engines sharing it, and restarts,
start in it and share their keys, and a restart never brings pre-reset keys back.

Storage key layout: 8 bytes of generation, 2 bytes of group (little endian), the block
hash (int hashes as 32 bytes, little endian).
"""

from __future__ import annotations

import itertools
import secrets

from kv_offload.types import HOST_BIT, STORAGE_BIT, KeyChange, KeyChanges, Location, OffloadKey

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
    Driven by one thread at a time (the caller's lock).

    Memory layout, for the garbage collector: per group, dicts keyed by the block hash
    (bytes) whose values are None or a small int. Python untracks a dict that holds
    nothing it tracks, so a full collection skips these however many keys they hold; keyed
    by `(hash, group)` tuples (each one tracked when created) they would be traversed
    entry by entry at every full collection (~50 ms per million keys; a set, ~150 ms)."""

    def __init__(self, *, report_storage_copies: bool = False) -> None:
        # Whether a host key's copy in the storage tier is a change of its own (KV events
        # announce both media); without it, a write-through costs no report entry.
        self._storage_bit = _STORAGE if report_storage_copies else _ABSENT
        self._host: dict[int, dict[bytes | int, None]] = {}
        self._storage: dict[int, dict[bytes | int, None]] = {}
        self._reported: dict[int, dict[bytes | int, int]] = {}  # hash -> location code
        # Keys that may have changed since the last `take` (per group: hash -> None). Not
        # small while an inventory streams in faster than reports drain it.
        self._dirty: dict[int, dict[bytes | int, None]] = {}
        self._reset = False

    def location(self, key: OffloadKey) -> Location:
        block_hash, group = key
        if block_hash in self._host.get(group, _EMPTY):
            return Location.HOST
        return Location.STORAGE if block_hash in self._storage.get(group, _EMPTY) \
            else Location.ABSENT

    def in_storage(self, key: OffloadKey) -> bool:
        block_hash, group = key
        return block_hash in self._storage.get(group, _EMPTY)

    def storage_sample(self, n: int) -> list[OffloadKey]:
        """Up to `n` keys the storage tier holds (some may be in host memory too), the last
        found first. O(n)."""
        sample: list[OffloadKey] = []
        for group, hashes in self._storage.items():
            sample += ((h, group) for h in itertools.islice(reversed(hashes), n - len(sample)))
        return sample

    def host_added(self, keys) -> None:
        self._add(self._host, keys)

    def host_removed(self, keys) -> None:
        self._remove(self._host, keys)

    def storage_added(self, keys) -> None:
        self._add(self._storage, keys)

    def storage_removed(self, keys) -> None:
        self._remove(self._storage, keys)

    def replace_storage(self, keys) -> None:
        """Forget every storage key and hold `keys` instead (another generation's, adopted
        mid-run: `TieredStore.settle_generation`); host keys stay. O(storage keys)."""
        for group, hashes in self._storage.items():
            dirty = self._dirty.setdefault(group, {})
            for block_hash in hashes:
                dirty[block_hash] = None
        self._storage = {}
        self.storage_added(keys)

    def reset(self) -> None:
        """Forget everything; the next `take` tells the reader to forget too (O(1) here,
        and O(1) for the reader: no per-key removal is reported)."""
        self._host, self._storage, self._reported, self._dirty = {}, {}, {}, {}
        self._reset = True

    def take(self, max_keys: int) -> KeyChanges:
        """Up to `max_keys` keys whose location, or a host key's storage copy
        (`KeyChange.in_storage`), differs from what was last reported."""
        changes: list[KeyChange] = []
        reported = self._reported
        for group, dirty in self._dirty.items():
            host, storage = self._host.get(group, _EMPTY), self._storage.get(group, _EMPTY)
            group_reported = reported.get(group)
            if group_reported is None:
                group_reported = reported[group] = {}
            while dirty and len(changes) < max_keys:
                block_hash, _ = dirty.popitem()
                # (int codes, not Location members: an Enum member hashes in Python code;
                # a bit per tier, so a host key's write-through is a change too)
                code = _HOST | (self._storage_bit if block_hash in storage else _ABSENT) \
                    if block_hash in host else _STORAGE if block_hash in storage else _ABSENT
                if group_reported.get(block_hash, _ABSENT) == code:
                    continue
                changes.append(KeyChange((block_hash, group), _LOCATIONS[code],
                                         code == _HOST_AND_STORAGE))
                if code == _ABSENT:
                    del group_reported[block_hash]
                else:
                    group_reported[block_hash] = code
        batch = KeyChanges(tuple(changes), self._reset)
        self._reset = False
        return batch

    @property
    def num_pending(self) -> int:
        """Keys that may still have a change to report."""
        return sum(len(dirty) for dirty in self._dirty.values())

    def _add(self, held: dict[int, dict], keys) -> None:
        dirty = self._dirty
        for block_hash, group in keys:
            hashes = held.get(group)
            if hashes is None:
                hashes = held[group] = {}
            hashes[block_hash] = None
            group_dirty = dirty.get(group)
            if group_dirty is None:
                group_dirty = dirty[group] = {}
            group_dirty[block_hash] = None

    def _remove(self, held: dict[int, dict], keys) -> None:
        dirty = self._dirty
        for block_hash, group in keys:
            held.get(group, _EMPTY).pop(block_hash, None)
            group_dirty = dirty.get(group)
            if group_dirty is None:
                group_dirty = dirty[group] = {}
            group_dirty[block_hash] = None


_EMPTY: dict = {}  # (never written: `pop` on it finds nothing)
_ABSENT, _HOST, _STORAGE = 0, HOST_BIT, STORAGE_BIT  # location codes (bits)
_HOST_AND_STORAGE = HOST_BIT | STORAGE_BIT
_LOCATIONS = (Location.ABSENT, Location.HOST, Location.STORAGE, Location.HOST)  # by code
