"""JobBook: the bookkeeping every thread-pool tier shares (jobs, results, counters, notes).

A job is submitted with its keys, its keys finish one by one on I/O threads, and the job's
`TierJobResult` is queued for `poll` when its last key finished. Counters say what happened
(by name, e.g. ``read_failed_absent``); ``note`` logs a problem once per reason per minute,
so a thousand failing keys make one log line, not a thousand.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from kv_offload.backends.base import TierJobResult
from kv_offload.backends.common.io_threads import IoThreads
from kv_offload.errors import TierClosedError

NOTE_INTERVAL_S = 60.0


class Job:
    """A submitted job: per-key outcome, finished when no key is left pending."""

    def __init__(self, job_id: int, keys: Sequence[bytes]) -> None:
        self.job_id = job_id
        self.keys = tuple(keys)
        self.succeeded = [False] * len(keys)
        self.pending = len(keys)

    def result(self) -> TierJobResult:
        return TierJobResult(self.job_id, self.keys, tuple(self.succeeded))


class JobBook:
    """Thread-safe jobs, results and counters of one tier (``name`` is used in errors)."""

    def __init__(self, name: str, logger: logging.Logger) -> None:
        self.name = name
        self._logger = logger
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._results: deque[TierJobResult] = deque()
        self._counts: Counter[str] = Counter()
        self._noted: dict[str, float] = {}
        self.closed = False

    def new_job(self, keys: Sequence[bytes]) -> Job:
        """A job for ``keys``; raises ``TierClosedError`` after ``close``. A job without
        keys is finished at once."""
        with self._lock:
            if self.closed:
                raise TierClosedError(f"this {self.name} is closed; submit jobs before close()")
            job = Job(next(self._ids), keys)
            if not keys:
                self._results.append(job.result())
            return job

    def finish(self, job: Job, indices: Sequence[int], ok: bool) -> None:
        """Keys ``indices`` of ``job`` are done; queue the result once every key is."""
        if not indices:
            return
        with self._lock:
            for i in indices:
                job.succeeded[i] = ok
            job.pending -= len(indices)
            if job.pending == 0:
                self._results.append(job.result())

    def start(self, pool: Executor | IoThreads, fn: Callable[..., None], *args: object) -> None:
        """Hand one task of a job to the I/O pool (a pool that a concurrent ``close`` shut
        down refuses it: ``TierClosedError``, as for any submit after close)."""
        try:
            pool.submit(fn, *args)
        except RuntimeError as e:
            raise TierClosedError(f"this {self.name} was closed while a job was submitted") \
                from e

    def poll(self) -> list[TierJobResult]:
        with self._lock:
            done = list(self._results)
            self._results.clear()
        return done

    def close(self) -> bool:
        """Refuse new jobs; True the first time (the caller then releases resources)."""
        with self._lock:
            first = not self.closed
            self.closed = True
            return first

    def count(self, *names: str, n: int = 1) -> None:
        with self._lock:
            for name in names:
                self._counts[name] += n

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def note(self, reason: str, message: str, *args: object) -> None:
        """Log a warning, at most once per ``reason`` every ``NOTE_INTERVAL_S`` seconds."""
        now = time.monotonic()
        with self._lock:
            last = self._noted.get(reason)
            if last is not None and now - last < NOTE_INTERVAL_S:
                return
            self._noted[reason] = now
        self._logger.warning("kv-offload: " + message, *args)
