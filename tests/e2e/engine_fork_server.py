"""A process that imports vLLM once and forks a fresh child for every in-process engine run.

Why: every engine run used to start a new Python and import vLLM (half of a run's ~15 s
here); the end-to-end suite runs about forty engines. Forking after the import gives each
run a process that is as fresh as a new one for everything vLLM does at engine start-up (the
engine, its connector and its threads are all created in the child), without paying the
import again. The server stays single-threaded, so forking it is safe.

Protocol (one JSON object per line): the test process writes
`{"spec": path, "cwd": dir, "log": path, "env": {...}, "timeout_s": s}` to our stdin; we fork,
the child replaces its environment with `env`, moves into `cwd`, sends its stdout and stderr
to `log` and runs `vllm_runner.main`; we write `{"rc": exit code}` (124 when it ran past
`timeout_s` and its process group was killed). End of stdin ends the server.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import vllm_runner
from vllm import LLM, SamplingParams  # noqa: F401  (the import every child then shares)

import kv_offload.vllm  # noqa: F401  (the connector vLLM loads at engine start)

TIMED_OUT = 124


def run_child(job: dict) -> None:
    """In the forked child: become the engine process `job` describes. Never returns."""
    rc = 1
    try:
        os.setpgid(0, 0)  # (one group: a timeout kills the child and anything it started)
        os.environ.clear()
        os.environ.update(job["env"])
        os.chdir(job["cwd"])
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # (the child must never read the server's requests)
        os.dup2(log, 1)
        os.dup2(log, 2)
        rc = vllm_runner.main(["vllm_runner.py", job["spec"]])
    except BaseException:  # (reported through the log and the exit code, like a crash)
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def wait(pid: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return TIMED_OUT
        time.sleep(0.05)


def serve() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()  # (nothing buffered may be inherited and written twice)
        pid = os.fork()
        if pid == 0:
            run_child(job)
        rc = wait(pid, job["timeout_s"])
        sys.stdout.write(json.dumps({"rc": rc}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
