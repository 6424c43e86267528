"""Which keys each worker rank holds, as the scheduler side learns from the ranks' reports.

Contents:
- `RankKeys`: per rank, where it holds each key (host memory, the storage tier, or both); a
  key is a hit only when every rank holds it (each rank holds its own shard).
- `HeldBlocks`: `is_cached(group, block)` over one request's keys, for a lookup.
- The maps hold `types.HOST_BIT` | `types.STORAGE_BIT` per key, as the reports carry them;
  `held_by_all_mask` returns them too (KV events: a medium's blocks).

Every method costs what it is asked about: `apply` is O(changes reported), lookups O(ranks).

Layout, for Python's garbage collector: per rank, per group, a dict of block hash (bytes)
-> location code (int). The collector never tracks a dict that holds only bytes and ints,
so a full collection skips these maps however many keys they hold. Keyed by `(hash, group)`
tuples (each tracked when it is made) with `Location` values (tracked objects), the maps of
a million keys were walked entry by entry at every full collection: ~50 ms each on a 2-core
host, a pause of the engine's whole process. (`Location` members are not used as dict keys
either: an Enum member's hash runs in Python code.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import and_, or_

from kv_offload.hits import BlockPresence
from kv_offload.types import HOST_BIT, STORAGE_BIT, Location, OffloadKey

_EMPTY: dict = {}  # (never written)


class RankKeys:
    """Per rank: block hash -> where it holds it, one map per KV-cache group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._ranks: dict[int, dict[int, dict[bytes, int]]] = {}

    @property
    def complete(self) -> bool:
        """Whether every rank has reported at least once."""
        return len(self._ranks) >= self.world_size

    def apply(self, rank: int, keys: Sequence[OffloadKey], held: bytes,
              reset: bool = False) -> None:
        """One rank's report (`RankReport` columns: each key and the media bits it is held in
        now, 0 for none). `reset`: forget what it reported before (O(1): its maps are
        replaced)."""
        maps = self._ranks.get(rank)
        if maps is None or reset:
            maps = self._ranks[rank] = {}
        last_group, hashes = None, None
        for (block_hash, group), bits in zip(keys, held):  # (this loop runs per key)
            if group != last_group:
                hashes = maps.get(group)
                if hashes is None:
                    hashes = maps[group] = {}
                last_group = group
            if bits:
                hashes[block_hash] = bits
            else:
                hashes.pop(block_hash, None)

    def group_maps(self, group: int) -> list[dict[bytes, int]]:
        """Every rank's map of `group`, for lookups in bulk (none until every rank has
        reported: then nothing is held by all)."""
        if not self.complete:
            return []
        return [held.get(group, _EMPTY) for held in self._ranks.values()]

    def held_by_all_of(self, group: int, block_hashes: Sequence[bytes]) -> list[bool]:
        """Whether every rank holds each of these keys of `group`, in order. Runs in C
        (`map` over each rank map's `__contains__`): ~4x cheaper than a call per key."""
        maps = self.group_maps(group)
        if not maps:  # some rank has not reported yet: nothing is held by all
            return [False] * len(block_hashes)
        flags = list(map(maps[0].__contains__, block_hashes))
        for rank_held in maps[1:]:
            flags = list(map(and_, flags, map(rank_held.__contains__, block_hashes)))
        return flags

    def held_by_all(self, key: OffloadKey, where: Location | None = None) -> bool:
        """Whether every rank holds `key` (in host memory, if `where` is HOST)."""
        block_hash, group = key
        codes = [held.get(block_hash) for held in self.group_maps(group)]
        if not codes or None in codes:
            return False
        return where is None or all(code & (HOST_BIT if where is Location.HOST else STORAGE_BIT)
                                    for code in codes)

    def held_by_all_mask(self, key: OffloadKey) -> int:
        """The tiers every rank holds `key` in: `HOST_BIT` | `STORAGE_BIT`, 0 for none
        (O(ranks))."""
        block_hash, group = key
        maps = self.group_maps(group)
        if not maps:
            return 0
        mask = HOST_BIT | STORAGE_BIT
        for held in maps:
            mask &= held.get(block_hash, 0)
        return mask

    def keys_of(self, rank: int) -> list[OffloadKey]:
        """Every key `rank` holds (O(its keys): for a reset, which drops them all)."""
        return [(block_hash, group) for group, hashes in self._ranks.get(rank, _EMPTY).items()
                for block_hash in hashes]

    @property
    def num_keys(self) -> int:
        """Keys some rank holds (tests and tools: O(keys))."""
        return len({(block_hash, group) for held in self._ranks.values()
                    for group, hashes in held.items() for block_hash in hashes})


class HeldBlocks(BlockPresence):
    """`is_cached(group, block)` over one request's block keys (`hashes[group][block]`): the
    answers come from `RankKeys.held_by_all_of` a chunk of blocks at a time, in C, when a
    lookup first asks past what is known. Chunks start at `FIRST_CHUNK` blocks and double
    up to `CHUNK`: a key asked of a map of a million keys is a few cache misses (0.3 to 1
    us here), so a lookup that misses at block 0 asks 16 keys, not the whole prompt, and one
    that hits n blocks asks fewer than 2n + 16. `run` (a full-attention hit) finds the first
    block not held with `list.index`: a few C calls per chunk, not a call per block.
    `planned(group)`: keys counted as held besides (stores planned, not yet reported)."""

    FIRST_CHUNK = 16
    CHUNK = 256

    def __init__(self, keys: RankKeys, hashes: list[Sequence[bytes]],
                 planned: Callable[[int], Mapping[bytes, int]] = lambda group: _EMPTY
                 ) -> None:
        super().__init__(self._held)
        self._keys, self._hashes, self._planned = keys, hashes, planned
        self._flags: list[list[bool]] = [[] for _ in hashes]

    def _held(self, group: int, block: int) -> bool:
        flags = self._flags[group]
        if block >= len(flags):
            if block >= len(self._hashes[group]):
                return False
            flags = self._answer_past(group, block)
        return flags[block]

    def run(self, group: int, start: int, stop: int) -> int:
        flags, n = self._flags[group], start
        while n < stop:
            if n >= len(flags):
                if n >= len(self._hashes[group]):
                    break
                flags = self._answer_past(group, n)
            end = min(stop, len(flags))
            try:
                return flags.index(False, n, end) - start
            except ValueError:  # every block in [n, end) is held
                n = end
        return n - start

    def _answer_past(self, group: int, block: int) -> list[bool]:
        """Learn the answers up to `block` (and a chunk more): the flags list, grown."""
        flags, hashes = self._flags[group], self._hashes[group]
        stop = max(block + 1, len(flags) + min(self.CHUNK, max(self.FIRST_CHUNK, len(flags))))
        chunk = hashes[len(flags):stop]
        held = self._keys.held_by_all_of(group, chunk)
        planned = self._planned(group)
        if planned:  # (in C too)
            held = list(map(or_, held, map(planned.__contains__, chunk)))
        flags += held
        return flags
