"""Bytes under a directory tree, re-counted only where a directory changed.

Contents:
- `TreeSizes`: ``totals(path)`` -> `TreeTotals` (bytes of the files below ``path`` and the
  newest file mtime), remembering each directory's own files by the directory's mtime.

Why: the disk budget covers the whole root (``root_budget``), so every rescan counts the
bytes of what is not this tier's: layout directories of other fingerprints without a fresh
heartbeat (left by a crash, an older library version, another model) and anything else an
operator put under the root. Walking and ``stat``-ing all of it at every rescan cost ~3 us
per file per rank, on the engine's cores, for files that never change.

How: creating, renaming or deleting a file moves its directory's mtime. A directory whose
mtime has not moved since it was counted keeps its count: one ``stat`` of the directory
instead of one per file. Its sub-directories are still visited (each has its own mtime). As
in ``fanout_scan``, a directory changed less than ``SETTLE_S`` before it was counted is
counted again next time (a change in the same clock tick), and a few remembered directories
(``REVALIDATE_PER_CALL``, oldest count first) are re-counted at every call whatever their
mtime, so a file that grew in place without touching its directory (an append) is counted
within a bounded number of rescans.

Nothing here holds a lock; it runs in the tier's background rescan only.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass

SETTLE_S = 2.0
REVALIDATE_PER_CALL = 8  # remembered directories re-counted per `totals` call, oldest first


@dataclass(frozen=True)
class TreeTotals:
    """What a tree holds: bytes of its files, and the newest file mtime (-inf: none)."""

    bytes: int = 0
    newest: float = float("-inf")


@dataclass
class _Counted:
    """One directory's own files (not its sub-directories'), as of ``mtime_ns``."""

    mtime_ns: int | None  # None: count again at the next call
    files: TreeTotals
    subdirs: tuple[str, ...]
    counted_at: float


class TreeSizes:
    """Remembers per-directory counts between calls (see the module docstring)."""

    def __init__(self, skip_names: frozenset[str] = frozenset()) -> None:
        self._skip = skip_names  # file names never counted (e.g. heartbeats)
        self._dirs: dict[str, _Counted] = {}
        self.dirs_counted = 0  # directories listed (and their files stat-ed), all calls
        self.dirs_reused = 0  # directories whose count was reused (one stat each)

    def totals(self, path: str) -> TreeTotals:
        """Bytes and newest mtime of the files below ``path`` (symlinks not followed;
        entries that vanish or cannot be read are skipped)."""
        due = set(sorted(self._dirs, key=lambda p: self._dirs[p].counted_at)
                  [:REVALIDATE_PER_CALL]) if self._dirs else set()
        seen: set[str] = set()
        found = self._visit(path, due, seen, time.time())
        # Forget directories below ``path`` that are gone (a tree shrinks, too).
        prefix = os.path.join(path, "")
        for gone in [p for p in self._dirs
                     if (p == path or p.startswith(prefix)) and p not in seen]:
            del self._dirs[gone]
        return found

    def own_files(self, path: str) -> TreeTotals:
        """Bytes and newest mtime of the files directly in ``path`` (not below)."""
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return TreeTotals()
        counted = self._dirs.get(path)
        if counted is None or counted.mtime_ns != st.st_mtime_ns:
            counted = self._count(path, st, time.time())
        else:
            self.dirs_reused += 1
        return counted.files

    def forget(self, path: str) -> None:
        """Drop what is remembered below ``path`` (e.g. after deleting files there)."""
        prefix = os.path.join(path, "")
        for p in [p for p in self._dirs if p == path or p.startswith(prefix)]:
            del self._dirs[p]

    def _visit(self, path: str, due: set[str], seen: set[str], now: float) -> TreeTotals:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return TreeTotals()
        if not stat.S_ISDIR(st.st_mode):
            return TreeTotals()
        seen.add(path)
        counted = self._dirs.get(path)
        if (counted is None or counted.mtime_ns != st.st_mtime_ns or path in due):
            counted = self._count(path, st, now)
        else:
            self.dirs_reused += 1
        size, newest = counted.files.bytes, counted.files.newest
        for sub in counted.subdirs:
            below = self._visit(sub, due, seen, now)
            size, newest = size + below.bytes, max(newest, below.newest)
        return TreeTotals(size, newest)

    def _count(self, path: str, st: os.stat_result, now: float) -> _Counted:
        self.dirs_counted += 1
        size, newest, subdirs = 0, float("-inf"), []
        try:
            entries = list(os.scandir(path))
        except OSError:
            entries = []
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    subdirs.append(entry.path)
                    continue
                if entry.name in self._skip:
                    continue
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            size += info.st_size
            newest = max(newest, info.st_mtime)
        settled = now - st.st_mtime > SETTLE_S
        counted = _Counted(st.st_mtime_ns if settled else None, TreeTotals(size, newest),
                           tuple(subdirs), now)
        self._dirs[path] = counted
        return counted
