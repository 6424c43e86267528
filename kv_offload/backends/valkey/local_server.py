"""A throwaway Valkey/Redis server on loopback, for tests and `kv-offload bench`.

Runs the ``valkey-server`` or ``redis-server`` binary found on PATH (Debian's ``redis-server``
package: ``apt-get install -y redis-server``) on a free 127.0.0.1 port, with nothing saved to
disk (``--save ''``, no AOF) and a ``maxmemory`` with an eviction policy, as a cache runs. It
can be killed, restarted on the same port (empty, like a crashed cache) and paused, which is
what the fault tests need.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

BINARIES = ("valkey-server", "redis-server")


def server_binary() -> str | None:
    """The first Valkey/Redis server binary on PATH, or None."""
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalServer:
    """One server process on 127.0.0.1 (a context manager: stopped on exit)."""

    def __init__(self, maxmemory: str = "64mb", policy: str = "allkeys-lru",
                 port: int | None = None, binary: str | None = None) -> None:
        self.binary = binary or server_binary()
        if self.binary is None:
            raise FileNotFoundError(f"none of {BINARIES} is on PATH (Debian: apt-get install "
                                    f"-y redis-server)")
        self.maxmemory = maxmemory
        self.policy = policy
        self.port = port or free_port()
        self.workdir = tempfile.mkdtemp(prefix="kv-offload-valkey-")
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start (or restart, empty) the server on this port; wait until it answers PING."""
        log = open(os.path.join(self.workdir, "server.log"), "ab")  # noqa: SIM115 (the child keeps it)
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", self.workdir,
             "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy,
             "--maxmemory-samples", "10",  # a closer LRU than the default 5 samples
             "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.binary} did not start on port {self.port}: "
                                   f"{self.log_tail()}")
            time.sleep(0.02)

    def answers(self) -> bool:
        """Whether the server replies to PING now."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            with open(os.path.join(self.workdir, "server.log"), errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
