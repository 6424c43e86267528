"""A shared tier's background refresh: its `refresh()` every `interval_s` on its own thread.

Tiers whose keys other engines also write (Valkey, S3) learn of those writes in the background:
each call polls what the store offers (Valkey: keyspace notifications, then a few pages of a
paced SCAN; S3: a few pages of a paced listing), bounded per call; the filesystem tier has
its own rescanner (it also reconciles its budget).
A failed refresh is logged and the next one runs: a bug in one listing must not end the
refreshes silently. `stopping` is set by `stop()`, so a long listing can end early.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Refresher:
    """Calls `refresh` every `interval_s` (<= 0: never) once `start`ed, until `stop`."""

    def __init__(self, refresh: Callable[[], None], interval_s: float, *, name: str,
                 what: str) -> None:
        self.stopping = threading.Event()
        self._refresh = refresh
        self._interval_s = interval_s
        self._what = what  # for the log line: what is listed
        self._thread: threading.Thread | None = None
        if interval_s > 0:
            self._thread = threading.Thread(target=self._loop, daemon=True, name=name)

    def start(self) -> None:
        if self._thread is not None:
            self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop refreshing; waits for a refresh under way (it sees `stopping`), at most
        ``timeout_s`` (the thread is a daemon: one stuck past that cannot hold up exit)."""
        self.stopping.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self.stopping.wait(self._interval_s):
            try:
                self._refresh()
            except Exception:
                logger.exception("kv-offload: refresh of %s failed", self._what)
