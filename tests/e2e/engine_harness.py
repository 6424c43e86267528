"""Start the real vLLM CPU engine in a child process (vllm_runner.py) and read its JSON results.

The pytest process never imports vllm: engine processes, OpenMP settings and logging stay in
the child, and a crash there fails the test with the tail of the child's output. Engine
processes are forked from one server process that imported vLLM once per session
(engine_fork_server.py: saves the import, about half of a small engine run);
KV_OFFLOAD_E2E_NO_FORK=1 starts a new Python for every run instead.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from vllm_runner import RESULT_MARKER

RUNNER = Path(__file__).with_name("vllm_runner.py")
FORK_SERVER = Path(__file__).with_name("engine_fork_server.py")
ENGINE_BLOCK_SIZE = 32


def run_engine(
    spec: dict[str, Any],
    work_dir: Path,
    *,
    multiprocess: bool = False,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Run one engine over `spec` (see vllm_runner.py) and return its results.

    `multiprocess=False` keeps vLLM's engine core and worker inside one process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0), forked from the session's fork server: a few seconds
    per run on a quiet machine instead of about 45 s for a multiprocess engine.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    spec_path = work_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    child_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"}
    child_env.update(env or {})
    log_path = work_dir / "engine.log"
    if os.environ.get("KV_OFFLOAD_E2E_NO_FORK"):
        with log_path.open("w") as log_file:
            returncode = subprocess.run(
                [sys.executable, str(RUNNER), str(spec_path)], cwd=work_dir, env=child_env,
                stdout=log_file, stderr=subprocess.STDOUT, timeout=timeout_s,
            ).returncode
    else:
        returncode = _fork_server().run(spec_path, work_dir, log_path, child_env, timeout_s)
    log = log_path.read_text()
    lines = [ln for ln in log.splitlines() if ln.startswith(RESULT_MARKER)]
    if returncode != 0 or not lines:
        raise AssertionError(
            f"vLLM engine run failed (rc={returncode}); log in {work_dir}:\n{log[-4000:]}"
        )
    return json.loads(lines[-1][len(RESULT_MARKER):])


class _ForkServer:
    """The client of engine_fork_server.py: one request at a time (a lock), started at the
    first in-process engine run of the session and ended when pytest exits."""

    def __init__(self) -> None:
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        self._proc = subprocess.Popen(
            [sys.executable, str(FORK_SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, text=True)
        self._lock = threading.Lock()
        atexit.register(self.close)

    def run(self, spec: Path, cwd: Path, log: Path, env: dict[str, str],
            timeout_s: float) -> int:
        job = {"spec": str(spec), "cwd": str(cwd), "log": str(log), "env": env,
               "timeout_s": timeout_s}
        with self._lock:
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(json.dumps(job) + "\n")
            self._proc.stdin.flush()
            reply = self._proc.stdout.readline()
        if not reply:
            raise AssertionError(f"the engine fork server exited (rc={self._proc.poll()})")
        return int(json.loads(reply)["rc"])

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()  # (end of requests: the server returns)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()


_server: _ForkServer | None = None


def _fork_server() -> _ForkServer:
    global _server
    if _server is None or _server._proc.poll() is not None:
        _server = _ForkServer()
    return _server


def cacheable_prefix(prompt_len: int, block_size: int = ENGINE_BLOCK_SIZE) -> int:
    """Tokens a full prefix hit can cover: whole blocks, never the last prompt token."""
    return (prompt_len - 1) // block_size * block_size


def token_ids(pass_result: dict[str, Any]) -> list[list[int]]:
    return [req["token_ids"] for req in pass_result["requests"]]
