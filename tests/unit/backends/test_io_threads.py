"""IoThreads, the S3 tier's I/O threads: every queued task runs, in threads of its own, even
after one failed; shutdown lets the queue drain and refuses new tasks."""

from __future__ import annotations

import threading

import pytest

from kv_offload.backends.common.io_threads import IoThreads


def test_every_queued_task_runs_before_shutdown_returns():
    io = IoThreads(3, "test-io")
    done: list[int] = []
    lock = threading.Lock()

    def task(i: int) -> None:
        with lock:
            done.append(i)

    for i in range(500):
        io.submit(task, i)
    io.shutdown(wait=True)
    assert sorted(done) == list(range(500))


def test_a_failing_task_is_logged_and_the_next_ones_still_run(caplog):
    io = IoThreads(1, "test-io")
    done = threading.Event()

    def fail() -> None:
        raise ValueError("a bug in a task")

    io.submit(fail)
    io.submit(done.set)
    io.shutdown(wait=True)
    assert done.is_set()
    assert "an I/O task failed" in caplog.text


def test_a_task_submitted_after_shutdown_is_refused():
    io = IoThreads(2, "test-io")
    io.shutdown(wait=True)  # (never started: nothing to wait for)
    with pytest.raises(RuntimeError):
        io.submit(print, "late")


def test_the_threads_carry_the_name_and_run_the_initializer():
    names: list[str] = []
    io = IoThreads(2, "test-io", initializer=lambda: names.append(
        threading.current_thread().name))
    io.submit(lambda: None)
    io.shutdown(wait=True)
    assert sorted(names) == ["test-io_0", "test-io_1"]
