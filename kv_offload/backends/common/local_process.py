"""A throwaway server process on loopback, for tests and `kv-offload bench`: the part the
Valkey and S3 launchers share (a free port, a work directory with the server's log, start
and wait until it answers, SIGKILL as a crash would, restart on the same port).

A server must not outlive the process that started it (a test run or a bench killed with
SIGKILL runs no cleanup): on Linux the child asks the kernel, before it runs the server, for
SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``). The kernel sends it when the
*thread* that started the child ends, so start servers from a thread that lives as long as
they should (the main thread, in tests and the bench)."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int):
    """A ``preexec_fn``: SIGKILL this child when its parent dies (Linux; elsewhere nothing)."""
    def arm() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: no such call
            return
        if os.getppid() != parent:  # the parent died before we asked
            os.kill(os.getpid(), signal.SIGKILL)
    return arm


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
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=_die_with_parent(os.getpid()))
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
