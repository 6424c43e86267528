"""Long jobs in short steps, so that the engine's threads never wait long for us.

Contents:
- `Pacer`: counts units of work; every ``STEP_S`` seconds of it, releases a lock (if any),
  calls a pause, and takes the lock again.
- `let_others_run`: the default pause. `Pause`: its type (None: never pause).

Why time and not a fixed number of keys: the same step costs 3x more on a loaded 2-core host
than on an idle one; a time bound keeps every lock hold (and every stretch holding the
interpreter lock) short on any machine. A thread that releases a lock and takes it again at
once usually wins it back before a waiting thread even wakes up, and a CPU-bound Python thread
keeps the GIL for ``sys.getswitchinterval()`` (5 ms) while others wait: the pause (a short
sleep) hands both over.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

STEP_S = 0.00025  # the longest stretch of work between pauses
_CHECK_EVERY = 8  # units of work between two looks at the clock


def let_others_run() -> None:
    """The default pause between steps: release the GIL long enough for a waiter to run."""
    time.sleep(0.0001)


Pause = Callable[[], None] | None


class Pacer:
    """Splits a job into steps of at most ~``STEP_S``; a context manager holding ``lock``."""

    def __init__(self, pause: Pause, lock: threading.Lock | None = None) -> None:
        self._pause = pause
        self._lock = lock
        self._since = 0.0
        self._work = 0
        self.pauses = 0

    def __enter__(self) -> Pacer:
        if self._lock is not None:
            self._lock.acquire()
        self.restart()
        return self

    def restart(self) -> None:
        """Start a new step now (e.g. after the caller paused by itself)."""
        self._since = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self._lock is not None:
            self._lock.release()

    def tick(self, units: int = 1) -> bool:
        """Count work; pause if this step is over its time. True when it paused: whatever the
        lock guards may have changed meanwhile."""
        self._work += units
        if self._work < _CHECK_EVERY or self._pause is None:
            return False
        self._work = 0
        if time.perf_counter() - self._since < STEP_S:
            return False
        if self._lock is not None:
            self._lock.release()
        try:
            self._pause()
            self.pauses += 1
        finally:
            if self._lock is not None:
                self._lock.acquire()
        self._since = time.perf_counter()
        return True

    def over(self) -> bool:
        """Whether this step is over its time (for loops that stop instead of pausing)."""
        return self._pause is not None and time.perf_counter() - self._since >= STEP_S
