"""Failure episodes: one log line when something starts failing, one when it works again.

Contents:
- `FailureEpisodes`: counts failures by reason and logs per episode, not per key.

A full disk fails every write until space comes back: thousands of writes in a minute. Logging
each would bury the log (and cost time on the I/O threads); logging none would hide it. So the
first failure of an episode logs a warning with its reason, later ones are only counted, and
the first success after them ends the episode with one line saying how many failed meanwhile.
The counters (``<what>_failed``, ``<what>_failed_<reason>``, ``<what>_failure_episodes``) go
into the tier's stats, which the connector exports as metrics.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter


class FailureEpisodes:
    """Failures of one kind of operation (``what``: e.g. "write"), logged once per episode."""

    def __init__(self, what: str, counts: Counter[str], lock: threading.Lock,
                 logger: logging.Logger) -> None:
        self._what = what
        self._counts = counts  # shared with the tier's other counters, guarded by ``lock``
        self._lock = lock
        self._logger = logger
        self._failed_in_episode = 0

    @property
    def ongoing(self) -> bool:
        """Whether the last outcome was a failure."""
        return self._failed_in_episode > 0

    def failed(self, reason: str, detail: str, *, exc_info: bool = False) -> None:
        """Count a failure (``reason``: a short token such as ENOSPC); log it if it is the
        first one of an episode."""
        with self._lock:
            self._counts[f"{self._what}_failed"] += 1
            self._counts[f"{self._what}_failed_{reason}"] += 1
            first = self._failed_in_episode == 0
            self._failed_in_episode += 1
            if first:
                self._counts[f"{self._what}_failure_episodes"] += 1
        if first:
            self._logger.warning(
                "kv-offload: %s failed (%s): %s; further %s failures are counted, not logged, "
                "until one succeeds", self._what, reason, detail, self._what, exc_info=exc_info,
            )

    def succeeded(self) -> None:
        """End the episode, if one is going on (one log line)."""
        if self._failed_in_episode == 0:  # the common case: no lock
            return
        with self._lock:
            failed, self._failed_in_episode = self._failed_in_episode, 0
        if failed:
            self._logger.warning(
                "kv-offload: %ss work again after %d failed", self._what, failed
            )
