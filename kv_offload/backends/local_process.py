"""A throwaway server process on loopback, for tests and `kv-offload bench`: the part the
Valkey and S3 launchers share (a free port, a work directory with the server's log, start
and wait until it answers, SIGKILL as a crash would, restart on the same port)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def first_on_path(names: tuple[str, ...]) -> str | None:
    """The path of the first of these programs on PATH, or None."""
    return next((path for name in names if (path := shutil.which(name))), None)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalProcess:
    """One server process on 127.0.0.1 (a context manager: stopped on exit). A subclass
    says how to run it (`command`) and how to tell it is up (`answers`)."""

    name = "server"  # in error messages
    start_timeout_s = 10.0

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.workdir = tempfile.mkdtemp(prefix=f"kv-offload-{self.name}-")
        self.process: subprocess.Popen | None = None
        self.start()

    def command(self) -> list[str]:
        raise NotImplementedError

    def answers(self) -> bool:
        raise NotImplementedError

    def start(self, timeout_s: float | None = None) -> None:
        """Start (or restart, empty) the server on this port; wait until it answers."""
        with open(os.path.join(self.workdir, "server.log"), "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} did not start on port {self.port}: "
                                   f"{self.log_tail()}")
            time.sleep(0.02)

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

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
