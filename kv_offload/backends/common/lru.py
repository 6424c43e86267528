"""A least-recently-used order over millions of keys without long pauses.

Contents:
- `ShardedLRU`: key -> size in LRU order; ``NUM_SHARDS`` small insertion-ordered dicts and a
  heap of their oldest entries give the global order.
- `SegmentedLRU`: two of them, probation and protected (segmented LRU): a key enters
  probation; an access (a read, a hit a lookup found) moves it to protected, which holds at
  most ``protected_limit`` bytes. Eviction takes probation's least recent keys first, so a
  block stored once and never asked for again (a request's own tail, sliding-window blocks
  far from every hit point) goes before any block of a prefix that served a hit.

Why not one ``OrderedDict``: at a million keys, growing (or compacting) one hash table copies
all of it in one call: inserts then stall for 0.1-0.4 s every few hundred thousand writes,
holding the interpreter and the index lock. A shard holds ~1/4096 of the keys, so its resize
costs ~1/4096 too. Shards are plain dicts of bytes -> int: the garbage collector untracks them
(they hold no container), so a full collection does not walk a million entries either.

Order: every insert and access takes the next tick of a counter, stored with the size in the
dict value (``tick << SIZE_BITS | size``), and moves the key to the end of its shard: each
shard is ordered by tick. A heap holds ``(tick, shard)`` entries with the invariant that every
non-empty shard has an entry whose tick is at most the tick of its oldest key. Entries go stale
when that key is accessed or removed; stale entries are fixed when they reach the top (lazily),
so inserts, accesses and removals stay O(1) and walking the oldest keys costs
O(log shards) per key walked.

Shards double as the buckets a directory-scan merge diffs one at a time (``shard``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

NUM_SHARDS = 4096  # a power of two
SIZE_BITS = 44  # sizes below 16 TiB; ticks use the bits above
MAX_SIZE = (1 << SIZE_BITS) - 1  # the largest size a key may have (scans skip larger files)
_SIZE_MASK = MAX_SIZE


class ShardedLRU:
    """Keys with sizes in least-recently-used order. Not thread-safe: the caller locks."""

    def __init__(self) -> None:
        self._shards: list[dict[bytes, int]] = [{} for _ in range(NUM_SHARDS)]
        self._fronts: list[tuple[int, int]] = []  # (tick <= the shard's oldest tick, shard)
        self._tick = 0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, key: bytes) -> bool:
        return key in self._shards[hash(key) & (NUM_SHARDS - 1)]

    def contains_each(self, keys: Iterable[bytes]) -> list[bool]:
        """Whether each key is stored (one pass: the lookup path of every engine step)."""
        shards, mask = self._shards, NUM_SHARDS - 1
        return [key in shards[hash(key) & mask] for key in keys]

    def shard(self, index: int) -> dict[bytes, int]:
        """Shard ``index`` (read only: keys -> packed values), for scan merges."""
        return self._shards[index]

    @staticmethod
    def shard_of(key: bytes) -> int:
        return hash(key) & (NUM_SHARDS - 1)

    def size(self, key: bytes) -> int | None:
        packed = self._shards[hash(key) & (NUM_SHARDS - 1)].get(key)
        return None if packed is None else packed & _SIZE_MASK

    def put(self, key: bytes, size: int) -> int | None:
        """Insert ``key`` (or update it) as the most recent; returns its previous size."""
        if not 0 <= size <= _SIZE_MASK:
            raise ValueError(f"file size {size} out of range")
        index = hash(key) & (NUM_SHARDS - 1)
        shard = self._shards[index]
        old = shard.pop(key, None)
        if not shard:
            heapq.heappush(self._fronts, (self._tick, index))
        shard[key] = self._tick << SIZE_BITS | size
        self._tick += 1
        if old is None:
            self._len += 1
            return None
        return old & _SIZE_MASK

    def sizes_in_shard(self, index: int, keys: Iterable[bytes]) -> list[int]:
        """Sizes of ``keys``, all stored in shard ``index`` (one fast pass, for scan merges)."""
        shard = self._shards[index]
        return [shard[key] & _SIZE_MASK for key in keys]

    def set_size(self, key: bytes, size: int) -> None:
        """Change the size of a stored ``key``, keeping its place in the order."""
        shard = self._shards[hash(key) & (NUM_SHARDS - 1)]
        shard[key] = shard[key] & ~_SIZE_MASK | size

    def add(self, key: bytes, size: int) -> bool:
        """Insert an absent ``key`` as the most recent; False (nothing changes) if present."""
        index = hash(key) & (NUM_SHARDS - 1)
        shard = self._shards[index]
        if key in shard:
            return False
        if not 0 <= size <= _SIZE_MASK:
            raise ValueError(f"file size {size} out of range")
        if not shard:
            heapq.heappush(self._fronts, (self._tick, index))
        shard[key] = self._tick << SIZE_BITS | size
        self._tick += 1
        self._len += 1
        return True

    def touch(self, key: bytes) -> bool:
        """Make ``key`` the most recent; False if absent."""
        shard = self._shards[hash(key) & (NUM_SHARDS - 1)]
        packed = shard.pop(key, None)
        if packed is None:
            return False
        shard[key] = self._tick << SIZE_BITS | (packed & _SIZE_MASK)
        self._tick += 1
        return True

    def pop(self, key: bytes) -> int | None:
        """Remove ``key``; its size, or None if absent."""
        packed = self._shards[hash(key) & (NUM_SHARDS - 1)].pop(key, None)
        if packed is None:
            return None
        self._len -= 1
        return packed & _SIZE_MASK

    def keys(self) -> list[bytes]:
        """Every key, in no particular order."""
        return [key for shard in self._shards for key in shard]

    def oldest(self, skip: Callable[[bytes], bool] | None = None) -> Iterator[tuple[bytes, int]]:
        """(key, size) from the least recent on, leaving out keys for which ``skip`` is true.

        The caller must not change the LRU while the iterator is alive; close it (or run it
        out) before removing what it yielded.
        """
        fronts, shards = self._fronts, self._shards
        walking: list[tuple[int, int, bytes, Iterator[bytes]]] = []  # (tick, shard, key, rest)
        pulled: set[int] = set()
        try:
            while True:
                self._fix_top()
                if fronts and (not walking or fronts[0][0] < walking[0][0]):
                    _, index = heapq.heappop(fronts)  # this shard's oldest key is next: walk it
                    if index in pulled:  # a duplicate entry of a shard walked already
                        continue
                    pulled.add(index)
                    rest = iter(shards[index])
                    first = next(rest)
                    tick = shards[index][first] >> SIZE_BITS
                    heapq.heappush(walking, (tick, index, first, rest))
                    continue
                if not walking:
                    return
                _, index, key, rest = walking[0]
                following = next(rest, None)
                if following is None:
                    heapq.heappop(walking)
                else:
                    tick = shards[index][following] >> SIZE_BITS
                    heapq.heapreplace(walking, (tick, index, following, rest))
                if skip is None or not skip(key):
                    yield key, shards[index][key] & _SIZE_MASK
        finally:
            for index in pulled:  # give the walked shards their heap entries back
                shard = shards[index]
                if shard:
                    heapq.heappush(fronts, (shard[next(iter(shard))] >> SIZE_BITS, index))
            if len(fronts) > 4 * NUM_SHARDS:
                self._rebuild_fronts()

    def _fix_top(self) -> None:
        """Make the top heap entry exact: drop it for an empty shard, refresh it if stale."""
        fronts, shards = self._fronts, self._shards
        while fronts:
            tick, index = fronts[0]
            shard = shards[index]
            if not shard:
                heapq.heappop(fronts)
                continue
            oldest = shard[next(iter(shard))] >> SIZE_BITS
            if oldest == tick:
                return
            heapq.heapreplace(fronts, (oldest, index))

    def _rebuild_fronts(self) -> None:
        self._fronts = [
            (shard[next(iter(shard))] >> SIZE_BITS, index)
            for index, shard in enumerate(self._shards)
            if shard
        ]
        heapq.heapify(self._fronts)


class SegmentedLRU:
    """Probation and protected `ShardedLRU` segments (module docstring). Not thread-safe."""

    def __init__(self, protected_limit: int | None = None) -> None:
        self.probation = ShardedLRU()
        self.protected = ShardedLRU()
        self.protected_limit = protected_limit  # bytes; None: no limit
        self.protected_bytes = 0

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __contains__(self, key: bytes) -> bool:
        return key in self.probation or key in self.protected

    def contains_each(self, keys: Iterable[bytes]) -> list[bool]:
        keys = list(keys)
        return [a or b for a, b in zip(self.probation.contains_each(keys),
                                       self.protected.contains_each(keys))]

    def shard_keys(self, index: int) -> set[bytes]:
        """The keys of shard ``index`` in both segments (for scan merges)."""
        return self.probation.shard(index).keys() | self.protected.shard(index).keys()

    def sizes_in_shard(self, index: int, keys: Iterable[bytes]) -> list[int]:
        probation, protected = self.probation.shard(index), self.protected.shard(index)
        return [(protected[key] if (packed := probation.get(key)) is None else packed)
                & _SIZE_MASK for key in keys]

    def size(self, key: bytes) -> int | None:
        size = self.probation.size(key)
        return self.protected.size(key) if size is None else size

    def put(self, key: bytes, size: int) -> int | None:
        """Insert ``key`` (or update it) as the most recent of its segment (probation for a
        new key); returns its previous size."""
        if key in self.protected:
            old = self.protected.put(key, size)
            self.protected_bytes += size - (old or 0)
            self._demote()
            return old
        return self.probation.put(key, size)

    def set_size(self, key: bytes, size: int) -> None:
        if key in self.protected:
            self.protected_bytes += size - (self.protected.size(key) or 0)
            self.protected.set_size(key, size)
        else:
            self.probation.set_size(key, size)

    def add(self, key: bytes, size: int) -> bool:
        """Insert an absent ``key`` into probation; False (nothing changes) if present."""
        return key not in self.protected and self.probation.add(key, size)

    def touch(self, key: bytes) -> bool:
        """An access: ``key`` becomes the most recent protected key; False if absent."""
        if self.protected.touch(key):
            return True
        size = self.probation.pop(key)
        if size is None:
            return False
        self.protected.put(key, size)
        self.protected_bytes += size
        self._demote()
        return True

    def pop(self, key: bytes) -> int | None:
        size = self.probation.pop(key)
        if size is None:
            size = self.protected.pop(key)
            if size is not None:
                self.protected_bytes -= size
        return size

    def keys(self) -> list[bytes]:
        return self.probation.keys() + self.protected.keys()

    def oldest(self, skip: Callable[[bytes], bool] | None = None) -> Iterator[tuple[bytes, int]]:
        """(key, size) in eviction order: probation's least recent first, then protected's.
        The same contract as `ShardedLRU.oldest`."""
        yield from self.probation.oldest(skip)
        yield from self.protected.oldest(skip)

    def _demote(self) -> None:
        """Protected keys past the limit go back to probation, least recent first (as its
        most recent keys: they served hits, so they still outlive keys never asked for)."""
        limit = self.protected_limit
        while limit is not None and self.protected_bytes > limit and len(self.protected) > 1:
            walk = self.protected.oldest()
            key, size = next(walk)
            walk.close()
            self.protected.pop(key)
            self.protected_bytes -= size
            self.probation.put(key, size)
