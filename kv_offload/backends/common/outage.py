"""Outage: fail fast while a store's server is down or stalled, and say so once per episode.

A network tier bounds every call with a timeout, but a dead or paused server would still cost
every job that timeout. After a call fails for a reason that is the server's (refused,
reset, timed out), the tier asks ``should_try`` before each call: for ``retry_interval_s``
seconds the answer is no, and jobs fail at once as misses (the engine recomputes); then one
call is let through as a probe. Its success ends the episode, its failure starts another wait.

Each wait is jittered (full jitter: uniform over the interval, from a tenth of it so that a
burst of jobs right after a failure still fails fast): the engines of a fleet that lost the
same server at the same moment would otherwise all probe it at the same instants when it
comes back.

One warning when an episode starts, one info line when it ends (with how long it lasted and
how many calls failed fast): logs stay readable however many keys fail.
"""

from __future__ import annotations

import logging
import random
import threading
import time

MIN_JITTER = 0.1  # the shortest wait, as a fraction of retry_interval_s
MISSES = "its reads and writes are misses (recomputed)"


class Outage:
    """Thread-safe up/down state of one server, with a retry interval while down."""

    def __init__(self, what: str, retry_interval_s: float, logger: logging.Logger,
                 consequence: str = MISSES) -> None:
        self.what = what
        self.consequence = consequence  # what the episode costs, for its warning
        self.retry_interval_s = retry_interval_s
        self.episodes = 0  # how many times the server went down
        self.skipped = 0  # calls not attempted because the server was down
        self._logger = logger
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._next_try = 0.0
        self._skipped_at_start = 0

    @property
    def retry_at(self) -> float:
        """The monotonic time from which the next probe is let through (while down)."""
        return self._next_try

    def _wait(self) -> float:
        return self.retry_interval_s * random.uniform(MIN_JITTER, 1.0)

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def should_try(self) -> bool:
        """Whether to attempt a call now: always while up; while down, one probe per
        ``retry_interval_s`` (other callers fail fast meanwhile)."""
        with self._lock:
            if self._down_since is None:
                return True
            now = time.monotonic()
            if now >= self._next_try:
                self._next_try = now + self._wait()  # this caller is the probe
                return True
            self.skipped += 1
            return False

    def failed(self, error: BaseException) -> None:
        """A call failed because of the server: start (or extend) an episode."""
        with self._lock:
            now = time.monotonic()
            self._next_try = now + self._wait()
            if self._down_since is not None:
                return
            self._down_since = now
            self.episodes += 1
            self._skipped_at_start = self.skipped
        self._logger.warning(
            "kv-offload: %s failed (%s: %s); %s until it answers again, retried every %.1f s",
            self.what, type(error).__name__, error, self.consequence, self.retry_interval_s)

    def succeeded(self) -> None:
        """A call went through: end the episode, if one is open."""
        if self._down_since is None:  # (fast path, no lock: the common case)
            return
        with self._lock:
            if self._down_since is None:
                return
            lasted = time.monotonic() - self._down_since
            self._down_since = None
            skipped = self.skipped - self._skipped_at_start
        self._logger.info("kv-offload: %s answers again after %.1f s (%d calls failed fast "
                          "meanwhile)", self.what, lasted, skipped)


class Outages:
    """One ``Outage`` per server of a store made of several (a Valkey Cluster's primaries):
    jobs on a dead node fail fast while the others are served. Thread-safe."""

    def __init__(self, what: str, retry_interval_s: float, logger: logging.Logger,
                 consequence: str = MISSES) -> None:
        self._what = what  # e.g. "Valkey cluster at redis://host:port/0"
        self._retry_interval_s = retry_interval_s
        self._logger = logger
        self._consequence = consequence
        self._lock = threading.Lock()
        self._by_node: dict[str, Outage] = {}

    def of(self, node: str, label: str | None = None) -> Outage:
        """The Outage of ``node`` (made on first use; ``label`` names it in log lines)."""
        found = self._by_node.get(node)
        if found is None:
            with self._lock:
                found = self._by_node.setdefault(node, Outage(
                    label or f"{self._what} node {node}", self._retry_interval_s,
                    self._logger, self._consequence))
        return found

    @property
    def episodes(self) -> int:
        return sum(o.episodes for o in list(self._by_node.values()))

    @property
    def down(self) -> int:
        """How many servers are in an outage now."""
        return sum(o.down for o in list(self._by_node.values()))

    @property
    def skipped(self) -> int:
        return sum(o.skipped for o in list(self._by_node.values()))
