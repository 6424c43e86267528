"""Rescans of a layout directory that cost what changed, not what is stored.

Contents:
- `FanoutScanner`: remembers, per fan-out directory (``FANOUT_DIRS``: 256 of them), the
  directory's mtime when it was last listed and the keys it held. `full` lists everything
  (the start-up inventory); `changes` re-lists only the fan-out directories whose mtime moved
  since, plus a few others in rotation, and returns the keys that appeared and vanished.
- `FanoutChanges`: what one `changes` call found.
- `FanoutScanner.probe`: the files of given keys, one ``lstat`` each (``FilesystemTier.find``:
  a question proportional to the request, not to the directory), judged by `is_final_file`,
  the same test a listing applies to what it found.

Why: a rescan used to ``scandir`` every fan-out directory and ``stat`` every file in it, then
diff the whole listing against the whole index, every ``rescan_interval_s``. Over a directory
of 300k files (an operator restarting a node with a full cache) that was ~16% of the vLLM
worker's samples, on the cores and under the interpreter lock the engine needs: generation ran
at about half the throughput of the same engine over an empty directory
(``benchmarks/bench_full_directory.py``).

How, and why it is safe:
- Creating, renaming or deleting a file updates its directory's mtime (POSIX; NFS too, through
  the server). So a fan-out directory whose mtime has not moved holds the names it held: one
  ``stat`` of the directory replaces a listing of it. A changed directory is re-listed
  (``scandir``, names only: the name is the key) and diffed against what it held before; only
  the names new to it are ``stat``-ed (size and mtime, for the LRU). Known names, files that
  are not ours (any other name) and names in the wrong fan-out are never ``stat``-ed;
  temporary files (ours, for the stale sweep) are.
- An mtime only moves by the filesystem clock's tick: a change made in the same tick as our
  listing would leave it unchanged. A directory whose mtime is younger than ``SETTLE_S`` at
  listing time is therefore not trusted and is listed again at the next scan.
- Keys this process wrote (`wrote`) join what their directory is known to hold, so a file of
  ours deleted by another process before our next listing is still noticed as vanished.
- Rotation: every scan also re-lists ``REVALIDATE_PER_SCAN`` fan-out directories whatever
  their mtime, so anything a mtime could hide (clock skew on a shared filesystem, an NFS
  attribute cache) is found within ``256 / REVALIDATE_PER_SCAN`` scans, and stale temporary
  files of other hosts in quiet directories are swept. (A temporary file is timed from the
  first listing that saw it: each `_Fanout` keeps a ``FileWatch`` of its temporary files.)

Not noticed: a file rewritten in place with another size under the same name (our writers
rename new files into place, and the same key always names the same bytes); a read of a file
of the wrong size is a miss and removes it.

Work per scan: 256 directory ``stat`` calls, plus one ``scandir`` per changed or rotated
directory, plus one ``stat`` per new name. Nothing here holds a lock the tier's callers take.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kv_offload.backends.common.listing import ScanListing
from kv_offload.backends.common.lru import MAX_SIZE
from kv_offload.backends.filesystem.directory import FANOUT_DIRS, is_stale_temp
from kv_offload.backends.filesystem.fileformat import (
    TEMP_PREFIX,
    fanout_dir_name,
    key_from_file_name,
    relative_path,
)
from kv_offload.backends.filesystem.io_engine import unlink_quietly
from kv_offload.backends.filesystem.watch import FileWatch

SETTLE_S = 2.0  # a directory changed less than this before its listing is listed again
REVALIDATE_PER_SCAN = 8  # fan-out dirs re-listed per scan whatever their mtime (256/8 = 32)


def is_final_file(info: os.stat_result) -> bool:
    """Whether a key's name (``lstat``-ed: a link is never followed) is a file the index may
    adopt: a regular file of a size the index can hold (a sparse file of 16 TiB or more is
    nobody's record). The one test of a listing and of a `FanoutScanner.probe`."""
    return stat.S_ISREG(info.st_mode) and info.st_size <= MAX_SIZE


@dataclass
class _Fanout:
    """What one fan-out directory held when last listed."""

    mtime_ns: int | None = None  # None: list it at the next scan
    # Keys, as a dict of None values: the garbage collector untracks dicts of bytes -> None,
    # so 300k known keys cost its collections nothing (a set is always tracked).
    keys: dict[bytes, None] = field(default_factory=dict)
    # Temporary files listed here, timed by how long they stayed unchanged on our clock
    # (directory.is_stale_temp: their mtimes are never compared with a clock).
    temps: FileWatch = field(default_factory=FileWatch)


@dataclass
class FanoutChanges:
    """What one incremental scan found."""

    added: ScanListing = field(default_factory=ScanListing)  # names new to their directory
    vanished: list[bytes] = field(default_factory=list)  # known names no longer listed
    swept: int = 0  # stale temporary files removed
    listed_dirs: int = 0  # fan-out directories re-listed
    skipped_dirs: int = 0  # fan-out directories unchanged (one stat each)


class FanoutScanner:
    """Per-fan-out-directory state of one layout directory (see the module docstring)."""

    def __init__(self, layout_dir: str, host: str, stale_temp_s: float) -> None:
        self._layout_dir = layout_dir
        self._host = host
        self._stale_temp_s = stale_temp_s
        self._dirs = {name: _Fanout() for name in FANOUT_DIRS}
        self._written: deque[bytes] = deque()  # own writes not yet folded in (thread-safe)
        self._cursor = 0  # next fan-out directory of the rotation
        self._lock = threading.Lock()  # one scan at a time

    def wrote(self, key: bytes) -> None:
        """A file of ours landed under ``key`` (O(1); any thread)."""
        self._written.append(key)

    def probe(self, keys: Sequence[bytes]) -> ScanListing:
        """The files of ``keys`` there now (one ``lstat`` each, judged by `is_final_file`,
        as a listing judges what it finds). Takes no lock: a scan may run meanwhile (a key
        it also finds is adopted once; the index decides)."""
        found = ScanListing()
        for key in keys:
            try:
                info = os.lstat(os.path.join(self._layout_dir, relative_path(key)))
            except OSError:
                continue  # absent (or unreadable: as a listing that cannot stat it)
            if is_final_file(info):
                found.add(key, info.st_size, info.st_mtime)
        return found

    def full(self) -> FanoutChanges:
        """List every fan-out directory, ``stat``-ing every file of ours: the start-up
        inventory (``added`` holds every key found)."""
        with self._lock:
            for state in self._dirs.values():
                state.mtime_ns = None
                state.keys.clear()
            return self._scan(lambda name, st: True)

    def changes(self) -> FanoutChanges:
        """Re-list the fan-out directories that changed since their last listing (and the
        next few of the rotation); see the module docstring."""
        with self._lock:
            while self._written:  # (popleft: safe against concurrent appends)
                key = self._written.popleft()
                self._dirs[fanout_dir_name(key)].keys[key] = None
            rotation = {FANOUT_DIRS[(self._cursor + i) % len(FANOUT_DIRS)]
                        for i in range(REVALIDATE_PER_SCAN)}
            self._cursor = (self._cursor + REVALIDATE_PER_SCAN) % len(FANOUT_DIRS)

            def due(name: str, st: os.stat_result | None) -> bool:
                state = self._dirs[name]
                return (name in rotation or st is None or state.mtime_ns is None
                        or st.st_mtime_ns != state.mtime_ns)

            return self._scan(due)

    def _scan(self, due) -> FanoutChanges:
        found = FanoutChanges()
        now = time.time()
        for name in FANOUT_DIRS:
            path = os.path.join(self._layout_dir, name)
            try:
                st = os.stat(path)
            except OSError:
                st = None  # (removed: listed below as empty, recreated by the next write)
            if not due(name, st):
                found.skipped_dirs += 1
                continue
            found.listed_dirs += 1
            self._relist(name, path, st, now, found)
        return found

    def _relist(self, name: str, path: str, st: os.stat_result | None, now: float,
                found: FanoutChanges) -> None:
        state = self._dirs[name]
        try:
            entries = list(os.scandir(path)) if st is not None else []
        except OSError:
            entries = []
        known, listed = state.keys, {}
        temps = []
        for entry in entries:
            key = key_from_file_name(entry.name)
            if key is None:
                if entry.name.startswith(TEMP_PREFIX):
                    temps.append(entry.name)
                    found.swept += self._sweep_temp(entry, state.temps)
                continue  # not ours: never stat-ed
            if key in known:
                listed[key] = None  # (a known name: no stat)
                continue
            if fanout_dir_name(key) != name:
                continue  # a key's name in the wrong directory: not ours to serve
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # vanished meanwhile
            if is_final_file(info):
                listed[key] = None
                found.added.add(key, info.st_size, info.st_mtime)
        found.vanished.extend(key for key in known if key not in listed)
        state.keys = listed
        state.temps.keep_only(temps)  # (swept ones are forgotten at the next listing)
        # Trust the mtime only if it is older than a clock tick or two (module docstring).
        settled = st is not None and now - st.st_mtime > SETTLE_S
        state.mtime_ns = st.st_mtime_ns if settled else None

    def _sweep_temp(self, entry: os.DirEntry, watch: FileWatch) -> int:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            return 0
        unchanged_s = watch.unchanged_for(entry.name, (st.st_ino, st.st_mtime_ns, st.st_size))
        if is_stale_temp(entry.name, self._host, unchanged_s, self._stale_temp_s):
            return int(unlink_quietly(entry.path))
        return 0
