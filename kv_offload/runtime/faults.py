"""Faults we contain instead of raising into the engine: counted, and logged once per episode.

An episode starts with the first failure at one place (`where`) and ends with a success
there at least `quiet_s` after its last failure. The first failure is logged with its
traceback, the rest of the episode is only counted, and the end of the episode is logged
with how many failures it held. So a dead server, a full disk or a flapping component
gives a couple of log lines, not one per key or per step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

logger = logging.getLogger("kv_offload")


class FaultLog:
    """Counts contained faults by place and logs each episode once. Thread-safe."""

    def __init__(self, owner: str, quiet_s: float = 10.0) -> None:
        self.owner = owner
        self.quiet_s = quiet_s
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}  # where -> failures in the current episode
        self._last: dict[str, float] = {}  # where -> time of its last failure
        self._counts: Counter[str] = Counter()  # where -> failures since the last take

    def failed(self, where: str, error: BaseException | str) -> None:
        """One failure at `where`; logs (with traceback) only the first of an episode."""
        with self._lock:
            first = where not in self._open
            self._open[where] = self._open.get(where, 0) + 1
            self._last[where] = time.monotonic()
            self._counts[where] += 1
        if first:
            if isinstance(error, BaseException):
                logger.error("%s: %s failed; contained (the engine goes on: affected loads "
                             "are recomputed, stores skipped)", self.owner, where,
                             exc_info=error)
            else:
                logger.warning("%s: %s failed: %s (further failures are counted, not "
                               "logged, until it recovers)", self.owner, where, error)

    def succeeded(self, where: str) -> None:
        """`where` worked: close its episode if it has been quiet for `quiet_s` (logged
        once, with its failure count)."""
        if where not in self._open:  # the common case: no lock, no work
            return
        with self._lock:
            if time.monotonic() - self._last.get(where, 0.0) < self.quiet_s:
                return
            failures = self._open.pop(where, 0)
        if failures:
            logger.warning("%s: %s works again after %d failure(s)", self.owner, where,
                           failures)

    def take_counts(self) -> dict[str, int]:
        """Failures per place since the last call (for metrics)."""
        with self._lock:
            counts, self._counts = dict(self._counts), Counter()
        return counts

    @property
    def failing(self) -> list[str]:
        """Places whose episode is still open."""
        with self._lock:
            return sorted(self._open)
