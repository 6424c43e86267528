"""The disk budget covers the whole root: other layout directories, and who is still alive.

Contents:
- `touch_heartbeat`: mark a layout directory as used by a live tier, with the bytes it holds
  and a beat counter.
- `survey_root`: bytes under the root outside this tier's layout directory, per directory,
  and which layout directories are stale (no live tier uses them).
- `evict_stale`: delete the oldest files of stale layout directories, then empty directories.
- `fit_root`: all of the above for one tier: the budget share left for its own keys.
- `warn_if_larger_than_the_filesystem`: a start-up warning about an impossible budget.
- `RootSurvey`, `ForeignDir`, `StaleEviction`, `RootFit`, `Heartbeat`: what they report.

Why: every model change, upgrade or library format change gets a new layout directory (the
layout fingerprint names it). Budgeting only one's own directory lets the root grow without
bound. So ``fs_bytes_to_use`` bounds every file under ``fs_root_dir``. Layout directories
nobody uses any more are evicted (oldest files first) when the root is over budget. Live
tiers (the ranks of one engine, other engines on a shared directory) split the budget: each
evicts its own least recent keys to stay within its share (`RootSurvey.share`), and never
touches another live tier's directory. Files that are not ours count and are never deleted.

Liveness: every tier rewrites ``HEARTBEAT_NAME`` in its layout directory at each rescan (and
at least every quarter of ``heartbeat_timeout_s``), with a beat counter in it. A directory is
live while this process has seen its heartbeat change (inode, mtime, size or content: the
counter changes it every time) within the last ``heartbeat_timeout_s`` of this process's
monotonic clock (``watch.FileWatch``). A directory without a heartbeat (engines of older
library versions write none), or whose heartbeat stopped changing, is judged by its files
instead: live while their total bytes or newest mtime changed within that time. No file time
is ever compared with a clock: a wall clock that jumps, or hosts whose clocks disagree on a
shared filesystem, can neither make a live directory look abandoned nor an abandoned one
look live (the old rule, "mtime younger than the timeout", evicted a live engine's directory
after a clock step of more than the timeout). Directory mtimes are not used: deleting stale
files would refresh them.

What this costs: a directory is stale only once this process has watched it unchanged for
the whole timeout, so a tier that just started evicts nothing for one ``heartbeat_timeout_s``;
a directory whose heartbeat stopped is walked from then on and needs its files to stay
unchanged one more timeout (an engine of an older version may still use a directory a
newer one left). So a dead directory is reclaimed, at the earliest, two timeouts after its
heartbeat stopped or this process first looked at it, whichever is later (one timeout for a
directory without a heartbeat). Files this tier deleted from a stale directory do not count
as a change when the survey right after the eviction sees it (``FileWatch.excuse``).

Cost: a live tier writes the bytes it holds into its heartbeat, so the others read one small
file per live directory instead of stating its every file (8 ranks of a million files each
would otherwise stat 7 million files per rescan, each). Only directories without a fresh
heartbeat (stale ones, or older library versions) and what is not a layout directory are
counted, through a `TreeSizes` the rescanner keeps: a directory whose mtime has not moved
since the last survey costs one ``stat``, not one per file (``tree_sizes``). (Heartbeat files
themselves, 64 bytes each, are not counted.)

Files that are not in a layout directory (anything else an operator put under the root) count
against the budget but are never deleted. All of this runs in the tier's background rescan,
never on a caller's path, and holds no lock.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from dataclasses import dataclass, field

from kv_offload.backends.filesystem.fileformat import GENERATION_NAME
from kv_offload.backends.filesystem.io_engine import NotRegularFile, open_regular, unlink_quietly
from kv_offload.backends.filesystem.tree_sizes import TreeSizes
from kv_offload.backends.filesystem.watch import FileWatch

logger = logging.getLogger(__name__)

HEARTBEAT_NAME = ".kv-alive"
_HEARTBEAT_SIZE = 64  # written; read: up to _HEARTBEAT_READ (a longer one still changes)
_HEARTBEAT_READ = 128
# The first line is what older versions parse (they ignore the rest); the beat counter on the
# second line makes every touch a change whatever the filesystem's time stamps do.
_HEARTBEAT = re.compile(rb"kv-offload heartbeat: (\d+) bytes\n")
_BEATS = itertools.count(1)
_BEAT_MODULO = 10**9  # (keeps the record within _HEARTBEAT_SIZE)
# layout_dir_name() of any format version: "kv-v<version>-<hex digest of the fingerprint>"
_NOT_COUNTED = frozenset({HEARTBEAT_NAME})
_LAYOUT_DIR = re.compile(r"^kv-v[0-9A-Za-z._]+-[0-9a-f]+$")


@dataclass
class ForeignDir:
    """A layout directory under the root that is not this tier's."""

    path: str
    live: bool
    bytes: int = 0


@dataclass(frozen=True)
class RootSurvey:
    """Bytes under the root outside this tier's layout directory."""

    layout_dirs: tuple[ForeignDir, ...] = ()
    other_bytes: int = 0  # not in any layout directory: counted, never deleted

    @property
    def foreign_bytes(self) -> int:
        return self.other_bytes + sum(d.bytes for d in self.layout_dirs)

    def share(self, budget: int) -> int:
        """The bytes this tier may keep: ``budget`` minus the files that are not ours, split
        fairly among the live tiers: each other live tier is counted with what it holds, but
        at most its fair part (an even split). A tier that started late therefore gets its
        part even while an earlier one fills the whole root (the earlier one shrinks to its
        part at its next rescan); a tier that needs less leaves the rest to the others.
        Stale bytes are not taken off: they are the first to go when the root is over budget
        (a share without them would leave a tier stuck below a dead directory for good)."""
        available = budget - self.other_bytes
        live = [d.bytes for d in self.layout_dirs if d.live]
        fair = available // (len(live) + 1)
        return max(0, available - sum(min(held, fair) for held in live))

    @property
    def stale_bytes(self) -> int:
        return sum(d.bytes for d in self.layout_dirs if not d.live)

    @property
    def live_dirs(self) -> int:
        return sum(d.live for d in self.layout_dirs)


@dataclass
class StaleEviction:
    """What `evict_stale` deleted."""

    files: int = 0
    bytes: int = 0
    dirs_removed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Heartbeat:
    """What a layout directory's heartbeat showed: its signature (any change of it is a
    beat) and the bytes its tier says it holds (None: no number, torn or an older
    version's)."""

    signature: tuple[int, int, int, bytes]  # (inode, mtime in ns, size, content)
    held: int | None


def touch_heartbeat(layout_dir: str, held_bytes: int) -> None:
    """Mark ``layout_dir`` as used now by a tier holding ``held_bytes``. Written in place, at
    a fixed size: a reader that catches a torn write finds no number and walks the directory
    instead (and sees a change: live)."""
    path = os.path.join(layout_dir, HEARTBEAT_NAME)
    beat = next(_BEATS) % _BEAT_MODULO
    line = f"kv-offload heartbeat: {held_bytes} bytes\nbeat {beat}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    try:
        os.pwrite(fd, line.ljust(_HEARTBEAT_SIZE), 0)
    finally:
        os.close(fd)


def _read_heartbeat(layout_dir: str) -> Heartbeat | None:
    """A layout directory's heartbeat, None when it has none (or it cannot be read)."""
    try:
        with os.fdopen(open_regular(os.path.join(layout_dir, HEARTBEAT_NAME)), "rb") as f:
            st = os.fstat(f.fileno())
            content = f.read(_HEARTBEAT_READ)
    except (OSError, NotRegularFile):
        return None
    found = _HEARTBEAT.match(content)
    return Heartbeat((st.st_ino, st.st_mtime_ns, st.st_size, content),
                     int(found.group(1)) if found else None)


def _beating(layout_dir: str, heartbeat: Heartbeat | None, watch: FileWatch,
             live_window_s: float) -> bool:
    """Whether ``watch`` saw this heartbeat change within ``live_window_s``."""
    if heartbeat is None:
        return False
    name = os.path.join(layout_dir, HEARTBEAT_NAME)
    return watch.unchanged_for(name, heartbeat.signature) < live_window_s


def _files_under(path: str):
    """(path, size, mtime) of every file below ``path`` (symlinks not followed); entries that
    vanish or cannot be read (another user's directory) are skipped."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                yield from _files_under(entry.path)
                continue
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        yield entry.path, st.st_size, st.st_mtime


def survey_root(root: str, own_layout_dir: str, watch: FileWatch | None,
                live_window_s: float, sizes: TreeSizes | None = None) -> RootSurvey:
    """Sizes of everything under ``root`` but ``own_layout_dir``, and which layout dirs are
    live (``watch`` saw their heartbeat, or else their files, change within
    ``live_window_s``: see the module docstring; None: a new watch, which sees everything
    for the first time, so every layout dir is live). A live directory whose heartbeat says
    what it holds is not walked; the rest is counted through ``sizes`` (`TreeSizes`: a
    directory unchanged since the last survey costs one ``stat``; None: count everything
    now)."""
    if sizes is None:
        sizes = TreeSizes(_NOT_COUNTED)
    if watch is None:
        watch = FileWatch()
    layout_dirs: list[ForeignDir] = []
    watched: list[str] = []
    other = 0
    own = os.path.basename(os.path.normpath(own_layout_dir))
    for entry in os.scandir(root):
        if entry.name == own:
            continue
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            continue
        if is_dir and _LAYOUT_DIR.match(entry.name):
            heartbeat = _read_heartbeat(entry.path)
            watched.append(os.path.join(entry.path, HEARTBEAT_NAME))
            beating = _beating(entry.path, heartbeat, watch, live_window_s)
            if beating and heartbeat.held is not None:  # live, and says its size
                layout_dirs.append(ForeignDir(entry.path, live=True, bytes=heartbeat.held))
                continue
            totals = sizes.totals(entry.path)  # (heartbeats: 64 bytes, not counted)
            watched.append(entry.path)
            # (the time stamp only as part of what changed, never compared with a clock)
            changing = watch.unchanged_for(entry.path, (totals.bytes, totals.newest)) \
                < live_window_s
            layout_dirs.append(ForeignDir(entry.path, live=beating or changing,
                                          bytes=totals.bytes))
        elif is_dir:
            other += sizes.totals(entry.path).bytes
    other += sizes.own_files(root).bytes  # (files directly under the root)
    watch.keep_only(watched)  # (directories gone, or beating again: forgotten)
    return RootSurvey(tuple(layout_dirs), other)


def evict_stale(
    stale: list[ForeignDir], nbytes: int, watch: FileWatch, live_window_s: float
) -> StaleEviction:
    """Delete the oldest files of the ``stale`` layout directories until ``nbytes`` are freed,
    then remove the directories left empty. A directory whose heartbeat changed since the
    survey is skipped; the deletions are excused in ``watch`` (they are no sign of life)."""
    done = StaleEviction()
    dirs = [d for d in stale
            if not _beating(d.path, _read_heartbeat(d.path), watch, live_window_s)]
    files = sorted(
        (mtime, size, path, d.path)
        for d in dirs
        for path, size, mtime in _files_under(d.path)
        # (the generation record goes last, with the directory: evicted while keys of an
        # older generation remain, a restart would serve them again)
        if os.path.basename(path) not in (HEARTBEAT_NAME, GENERATION_NAME)
    )
    touched: set[str] = set()
    for _, size, path, layout_dir in files:
        if done.bytes >= nbytes:
            break
        if unlink_quietly(path):
            done.files += 1
            done.bytes += size
            touched.add(layout_dir)
    for path in touched:
        watch.excuse(path)
    for d in dirs:
        if _prune(d.path):
            done.dirs_removed.append(d.path)
    return done


def _prune(layout_dir: str) -> bool:
    """Remove the empty sub-directories of ``layout_dir``, and it too if nothing else is left
    (its heartbeat aside). True if the directory is gone."""
    try:
        entries = list(os.scandir(layout_dir))
    except FileNotFoundError:
        return True
    left = False
    for entry in entries:
        if entry.name in (HEARTBEAT_NAME, GENERATION_NAME):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                os.rmdir(entry.path)
                continue
        except OSError:  # not empty (or vanished): keep it
            pass
        left = True
    if left:
        return False
    unlink_quietly(os.path.join(layout_dir, GENERATION_NAME))
    unlink_quietly(os.path.join(layout_dir, HEARTBEAT_NAME))
    try:
        os.rmdir(layout_dir)
    except OSError:  # a tier started using it again meanwhile
        return False
    return True


@dataclass(frozen=True)
class RootFit:
    """The outcome of `fit_root`: the root as surveyed, what was evicted, this tier's share."""

    survey: RootSurvey
    evicted: StaleEviction
    share_bytes: int


def fit_root(
    root: str, layout_dir: str, budget: int, own_bytes: int, live_window_s: float,
    sizes: TreeSizes | None = None, watch: FileWatch | None = None,
) -> RootFit:
    """Touch this tier's heartbeat, survey the root, evict stale layout directories (oldest
    files first) while the root is over ``budget``, and return this tier's share (see
    `RootSurvey.share`). ``watch`` is what this tier saw of the others at its earlier rescans
    (None: nothing, so nothing is stale yet). The root may exceed the budget between rescans:
    by what this tier wrote since its last one, or while a tier that holds more than its part
    has not yet rescanned and shrunk."""
    if watch is None:
        watch = FileWatch()
    touch_heartbeat(layout_dir, own_bytes)
    survey = survey_root(root, layout_dir, watch, live_window_s, sizes)
    evicted = StaleEviction()
    over = own_bytes + survey.foreign_bytes - budget
    if over > 0 and survey.stale_bytes:
        evicted = evict_stale(
            [d for d in survey.layout_dirs if not d.live], over, watch, live_window_s
        )
        survey = survey_root(root, layout_dir, watch, live_window_s, sizes)
    return RootFit(survey, evicted, survey.share(budget))


def warn_if_larger_than_the_filesystem(path: str, budget: int) -> None:
    """A budget the filesystem cannot hold ends in failed writes once it fills (a write needs
    room for its new file before it deletes the files it evicts): say so at start."""
    try:
        fs = os.statvfs(path)
    except OSError:
        return
    if budget > fs.f_blocks * fs.f_frsize:
        logger.warning(
            "kv-offload: fs_bytes_to_use (%d bytes) exceeds the size of the filesystem of %s "
            "(%d bytes); writes will fail once it is full", budget, path,
            fs.f_blocks * fs.f_frsize,
        )
