"""What a directory scan found: the input of an index merge.

Contents:
- `ScanListing`: the final files of one scan, as columns (keys, sizes, mtimes).
- `ScannedFile`: one file, for building listings by hand (tests, tools).
- `MergeResult`: what merging a listing changed in the index.

Columns rather than one object per file: a scan of a million files would otherwise create a
million objects that the garbage collector walks in collections that stall every thread of
the process. Sizes and mtimes are ``array`` columns (no references at all); keys are one list.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScannedFile:
    """One final file found by a directory scan."""

    key: bytes
    size: int
    mtime: float


@dataclass
class ScanListing:
    """The final files a scan found: row ``i`` is ``keys[i]``, ``sizes[i]``, ``mtimes[i]``."""

    keys: list[bytes] = field(default_factory=list)
    sizes: array = field(default_factory=lambda: array("q"))
    mtimes: array = field(default_factory=lambda: array("d"))

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: bytes, size: int, mtime: float) -> None:
        self.keys.append(key)
        self.sizes.append(size)
        self.mtimes.append(mtime)

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
