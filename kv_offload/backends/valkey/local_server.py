"""A throwaway Valkey/Redis server on loopback, for tests and `kv-offload bench`.

Runs the ``valkey-server`` or ``redis-server`` binary found on PATH (Debian's ``redis-server``
package: ``apt-get install -y redis-server``) on a free 127.0.0.1 port, with nothing saved to
disk (``--save ''``, no AOF) and a ``maxmemory`` with an eviction policy, as a cache runs. It
can be killed, restarted on the same port (empty, like a crashed cache) and paused, which is
what the fault tests need.
"""

from __future__ import annotations

import socket

from kv_offload.backends.local_process import LocalProcess, first_on_path, free_port

__all__ = ["BINARIES", "LocalServer", "free_port", "server_binary"]

BINARIES = ("valkey-server", "redis-server")


def server_binary() -> str | None:
    """The first Valkey/Redis server binary on PATH, or None."""
    return first_on_path(BINARIES)


class LocalServer(LocalProcess):
    """One Valkey/Redis server process on 127.0.0.1 (a context manager: stopped on exit)."""

    name = "valkey"

    def __init__(self, maxmemory: str = "64mb", policy: str = "allkeys-lru",
                 port: int | None = None, binary: str | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.binary = binary or server_binary()
        if self.binary is None:
            raise FileNotFoundError(f"none of {BINARIES} is on PATH (Debian: apt-get install "
                                    f"-y redis-server)")
        self.maxmemory = maxmemory
        self.policy = policy
        self.extra_args = tuple(extra_args)  # e.g. ("--requirepass", ...) for the auth tests
        super().__init__(port)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self.workdir,
                "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy,
                "--maxmemory-samples", "10",  # a closer LRU than the default 5 samples
                "--daemonize", "no", *self.extra_args]

    def answers(self) -> bool:
        """Whether the server replies to PING now (asking for a password counts)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False
