"""The filesystem tier's background work: rescans, the root-wide budget, heartbeats.

Contents:
- `Rescanner`: one thread per tier. At start it lists the whole layout directory (the
  inventory); then every ``rescan_interval_s`` it re-lists only the fan-out directories that
  changed (``fanout_scan``: one ``stat`` per unchanged directory, no ``stat`` of known or
  foreign files), merges what appeared and vanished into the index (short lock holds), sweeps
  stale temporary files, fits the whole root into the budget (``root_budget``, whose survey
  also skips unchanged directories) and evicts down to this tier's share. With rescans off
  (interval 0) it still touches the heartbeat, at least every quarter of
  ``heartbeat_timeout_s``, so that tiers of other layouts see this directory is alive.
  `find` is the targeted question of the tier's ``find``: named keys' files, adopted by the
  same checks and merge code as a rescan's, on the caller's thread.

Nothing here but `find` runs on a caller's path. The thread runs at the lowest CPU priority
(nice 19, a per-thread setting on Linux) and on kv-offload's CPUs (``affinity``), off the
cores vLLM pinned its forward pass to: what a rescan costs comes out of idle time first. An
exception (a flaky shared filesystem) never kills the thread: it is counted and logged once
per episode, and the next round tries again.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from kv_offload.backends.common.index import KeyIndex
from kv_offload.backends.common.listing import ScanListing
from kv_offload.backends.common.pacing import Pause, let_others_run
from kv_offload.backends.filesystem.config import FilesystemTierConfig
from kv_offload.backends.filesystem.episodes import FailureEpisodes
from kv_offload.backends.filesystem.fanout_scan import FanoutScanner
from kv_offload.backends.filesystem.root_budget import (
    HEARTBEAT_NAME,
    RootSurvey,
    TreeSizes,
    fit_root,
    touch_heartbeat,
)
from kv_offload.backends.filesystem.watch import FileWatch
from kv_offload.runtime.affinity import join_our_cpus

logger = logging.getLogger(__name__)


class Rescanner:
    """Rescans one tier's layout directory and keeps the root within the budget."""

    def __init__(
        self,
        config: FilesystemTierConfig,
        layout_dir: str,
        host: str,
        index: KeyIndex,
        delete: Callable[[list[bytes]], None],
        count: Callable[..., None],
        episodes: Callable[[str], FailureEpisodes],
    ) -> None:
        self._config = config
        self._layout_dir = layout_dir
        self._host = host
        self._index = index
        self._delete = delete  # deletes the files of evicted keys and counts them
        self._count = count
        self._failures = episodes("rescan")
        self._root_failures = episodes("root_survey")
        self._lock = threading.Lock()  # one rescan at a time (never taken by a caller)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-fs-rescan", daemon=True)
        self.root = RootSurvey()  # the root as the last rescan found it
        self._scanner = FanoutScanner(layout_dir, host, config.stale_temp_s)
        # Sizes of the directories outside ours, re-counted where a directory mtime moved.
        self._sizes = TreeSizes(frozenset({HEARTBEAT_NAME}))
        # What this tier saw of the other layout directories: liveness is judged by their
        # changes on our monotonic clock, never by their file times (root_budget).
        self._watch = FileWatch()
        self._inventoried = False  # whether the first (full) listing was merged
        self._starved = False  # whether the last rescan left this tier no room at all

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (waits for a rescan in progress)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def wrote(self, key: bytes) -> None:
        """A file of ours landed (O(1)): the next rescan notices if another process deletes
        it, even before its directory is listed again."""
        self._scanner.wrote(key)

    def find(self, keys: Sequence[bytes]) -> ScanListing:
        """Look for the files of ``keys`` now (`FanoutScanner.probe`: the checks of a
        listing) and adopt them as a rescan would (`KeyIndex.adopt`), without waiting for a
        rescan in progress (its lock is not taken). Found keys the index holds join what
        their directory is known to hold, as our own writes do (`wrote`): a later deletion
        by another process is noticed before the directory is listed again. Returns what
        was found."""
        found = self._scanner.probe(keys)
        adopted = self._index.adopt(found)
        listed = [f.key for f in found.files()]
        for key, held in zip(listed, self._index.contains(listed)):
            if held:  # (a key not adopted, e.g. removed during a scan, stays unknown: a
                self._scanner.wrote(key)  # later listing stats and offers it again)
        self._count("finds")
        self._count("find_keys", n=len(keys))
        self._count("find_adopted", n=adopted)
        return found

    def rescan(self, pause: Pause = let_others_run) -> None:
        """One round now (``pause``: between merge steps; None before anyone calls). The
        first lists everything; later ones only the fan-out directories that changed."""
        with self._lock:
            generation = self._index.start_scan()
            if not self._inventoried:
                found = self._scanner.full()
                merged = self._index.merge_scan(found.added, generation, pause)
                self._inventoried = True
            else:
                found = self._scanner.changes()
                merged = self._index.merge_changes(found.added, found.vanished, generation,
                                                   pause)
            swept = found.swept
            try:  # (an unreadable corner of a shared root must not stop this tier's upkeep)
                self._fit_root()
                self._root_failures.succeeded()
            except OSError as e:
                name = errno.errorcode.get(e.errno or 0, "EUNKNOWN")
                self._root_failures.failed(name, f"{self._config.root_dir}: {e}")
            self._delete(self._index.evict_to_budget(pause))
        self._count("rescans")
        self._count("rescan_dirs_listed", n=found.listed_dirs)
        self._count("rescan_dirs_skipped", n=found.skipped_dirs)
        self._count("temp_files_swept", n=swept)
        self._count("keys_adopted", n=merged.added)
        self._count("keys_vanished", n=merged.dropped)

    def _fit_root(self) -> None:
        config = self._config
        fit = fit_root(
            config.root_dir, self._layout_dir, config.bytes_to_use, self._index.used_bytes,
            config.heartbeat_timeout_s, self._sizes, self._watch,
        )
        self.root = fit.survey
        self._index.set_budget(fit.share_bytes)
        if (fit.share_bytes == 0) != self._starved:  # one line when it starts, one when it ends
            self._starved = fit.share_bytes == 0
            if self._starved:
                logger.warning(
                    "kv-offload: files that are not ours under %s fill the whole disk budget "
                    "(%d bytes): nothing can be stored", config.root_dir, config.bytes_to_use,
                )
            else:
                logger.warning("kv-offload: the disk tier under %s has room again",
                               config.root_dir)
        if fit.evicted.files:
            self._count("foreign_files_evicted", n=fit.evicted.files)
            self._count("foreign_bytes_evicted", n=fit.evicted.bytes)
            self._count("foreign_dirs_removed", n=len(fit.evicted.dirs_removed))
            logger.info(
                "kv-offload: the disk root %s was over budget: removed %d files (%d bytes) of "
                "layout directories no live engine uses", config.root_dir,
                fit.evicted.files, fit.evicted.bytes,
            )

    def _loop(self) -> None:
        join_our_cpus()  # (off the engine's cores, where vLLM pinned them)
        with contextlib.suppress(OSError, AttributeError):  # (not Linux: normal priority)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        heartbeat_s = self._config.heartbeat_timeout_s / 4
        interval = self._config.rescan_interval_s
        next_rescan = time.monotonic() + interval if interval > 0 else float("inf")
        while not self._stop.wait(max(0.0, min(heartbeat_s, next_rescan - time.monotonic()))):
            try:
                if time.monotonic() >= next_rescan:
                    next_rescan = time.monotonic() + interval
                    self.rescan()
                else:
                    touch_heartbeat(self._layout_dir, self._index.used_bytes)
                self._failures.succeeded()
            except Exception as e:
                self._failures.failed(
                    type(e).__name__, f"{self._layout_dir}: {e!r}", exc_info=True
                )
