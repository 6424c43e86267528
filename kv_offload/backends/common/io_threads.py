"""IoThreads: a tier's I/O threads and their queue of tasks, one small tuple per task.

Contents:
- `IoThreads(count, name, initializer)`: ``submit(fn, *args)`` queues a task, one of
  ``count`` threads runs it; ``shutdown(wait)`` lets the queued tasks run, then ends the
  threads. Results are not returned: a tier's task reports through its `JobBook` and
  catches its own errors (one that escapes is logged, and the thread goes on).

Why not a ``ThreadPoolExecutor`` (issue 25): each of its tasks is a ``Future`` (with a
``Condition``, its ``RLock``, bound methods and a waiters list) and a ``_WorkItem``: ~12
objects the garbage collector tracks, for a result nobody reads (a queued S3 write held 18
with the tier's own, 6 here: `tests/unit/backends/s3/test_write_queue_garbage.py`). A tier
queues one task per block, and when the store is slower than the engine's stores (an S3
endpoint, moto here) thousands wait for seconds: in `bench_step_cost.py --tier s3`, 5k to 11k queued
writes were 100k to 220k tracked objects, promoted into the old generation (they live long)
and walked by every full collection, i.e. most of each full collection's pause in the
engine's process. Here a task is one tuple (the function and its arguments) in a
``SimpleQueue``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class IoThreads:
    """``count`` threads running queued tasks in order (see the module docstring)."""

    def __init__(self, count: int, name: str,
                 initializer: Callable[[], None] | None = None) -> None:
        self._tasks: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # (submit vs shutdown: no task after the stop marks)
        self._closed = False
        self._initializer = initializer
        self._threads = [threading.Thread(target=self._run, name=f"{name}_{i}", daemon=True)
                         for i in range(count)]
        self._started = False  # (started by the first task: a tier that fails to start
        # or never does I/O leaves no idle threads behind)

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        """Queue ``fn(*args)``; RuntimeError after ``shutdown`` (as an executor's)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit a task after shutdown")
            if not self._started:
                self._started = True
                for thread in self._threads:
                    thread.start()
            self._tasks.put((fn, *args))

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new tasks; the queued ones still run, then the threads end (``wait``:
        this returns once they have)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                for _ in self._threads:
                    self._tasks.put(None)  # (one stop mark per thread, after every task)
        if wait and self._started:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()

    def _run(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while (task := self._tasks.get()) is not None:
            try:
                task[0](*task[1:])
            except Exception:  # (a task reports its own errors: this is a bug's last net)
                logger.exception("kv-offload: an I/O task failed")
            del task  # (not held while this thread waits for the next one)
