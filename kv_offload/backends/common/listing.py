"""What a scan found (a directory's files, a bucket prefix's objects): the input of an index merge.

Contents:
- `ScanListing`: the final files of one scan, already grouped by LRU shard.
- `ScannedFile`: one file, for building listings by hand (tests, tools).
- `MergeResult`: what merging a listing changed in the index.

A listing of a million files must not cost the rest of the process anything: the garbage
collector stalls every thread while it walks tracked containers, and a list of a million keys
(or a million small objects) is walked in full by young collections until it ages. So a
listing holds no tracked container of that size: keys go straight into one small dict per
shard (bytes -> row number: the collector untracks dicts of such values), sizes and mtimes
into ``array`` columns (no references at all). Grouping while scanning also saves the merge a
pass: it diffs each shard of the index against the same shard of the listing.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kv_offload.backends.common.lru import NUM_SHARDS, ShardedLRU


@dataclass(frozen=True)
class ScannedFile:
    """One final file found by a directory scan."""

    key: bytes
    size: int
    mtime: float


@dataclass
class ScanListing:
    """The final files a scan found: ``shards[ShardedLRU.shard_of(key)][key]`` is the row of
    ``key``, whose size and mtime are ``sizes[row]`` and ``mtimes[row]``."""

    shards: list[dict[bytes, int]] = field(default_factory=lambda: [{} for _ in range(NUM_SHARDS)])
    sizes: array = field(default_factory=lambda: array("q"))
    mtimes: array = field(default_factory=lambda: array("d"))

    def __len__(self) -> int:
        return sum(len(shard) for shard in self.shards)

    def __contains__(self, key: bytes) -> bool:
        return key in self.shards[ShardedLRU.shard_of(key)]

    def add(self, key: bytes, size: int, mtime: float) -> None:
        """Add a file (a key listed twice keeps its last size and mtime)."""
        self.shards[ShardedLRU.shard_of(key)][key] = len(self.sizes)
        self.sizes.append(size)
        self.mtimes.append(mtime)

    def files(self) -> Iterator[ScannedFile]:
        """Every file, as records (tests, tools)."""
        for shard in self.shards:
            for key, row in shard.items():
                yield ScannedFile(key, self.sizes[row], self.mtimes[row])

    @classmethod
    def of(cls, files: Iterable[ScannedFile]) -> ScanListing:
        listing = cls()
        for f in files:
            listing.add(f.key, f.size, f.mtime)
        return listing


@dataclass(frozen=True)
class MergeResult:
    """What merging one scan changed in the index."""

    added: int = 0
    dropped: int = 0
    resized: int = 0
