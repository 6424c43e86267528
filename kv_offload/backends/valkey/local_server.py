"""A throwaway Valkey/Redis server on loopback, for tests and `kv-offload bench`.

Runs the ``valkey-server`` or ``redis-server`` binary found on PATH (Debian's ``redis-server``
package: ``apt-get install -y redis-server``) on a free 127.0.0.1 port, with nothing saved to
disk (``--save ''``, no AOF) and a ``maxmemory`` with an eviction policy, as a cache runs. It
can be killed, restarted on the same port (empty, like a crashed cache) and paused, which is
what the fault tests need. With ``tls`` (a ``ServerTls``) it listens on TLS only
(``--port 0 --tls-port``) and asks clients for a certificate signed by the CA.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass

from kv_offload.backends.common.local_process import LocalProcess, first_on_path, free_port

__all__ = ["BINARIES", "LocalServer", "ServerTls", "free_port", "server_binary"]

BINARIES = ("valkey-server", "redis-server")


def server_binary() -> str | None:
    """The first Valkey/Redis server binary on PATH, or None."""
    return first_on_path(BINARIES)


@dataclass(frozen=True)
class ServerTls:
    """PEM files of a TLS server: its certificate and key, the CA it trusts for client
    certificates, and a client certificate + key it accepts (to check that it answers)."""

    cert_file: str
    key_file: str
    ca_file: str
    client_cert_file: str
    client_key_file: str

    def args(self) -> list[str]:
        return ["--tls-cert-file", self.cert_file, "--tls-key-file", self.key_file,
                "--tls-ca-cert-file", self.ca_file, "--tls-auth-clients", "yes"]

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file)
        context.load_cert_chain(self.client_cert_file, self.client_key_file)
        return context


class LocalServer(LocalProcess):
    """One Valkey/Redis server process on 127.0.0.1 (a context manager: stopped on exit)."""

    name = "valkey"

    def __init__(self, maxmemory: str = "64mb", policy: str = "allkeys-lru",
                 port: int | None = None, binary: str | None = None,
                 extra_args: tuple[str, ...] = (), tls: ServerTls | None = None) -> None:
        self.binary = binary or server_binary()
        if self.binary is None:
            raise FileNotFoundError(f"none of {BINARIES} is on PATH (Debian: apt-get install "
                                    f"-y redis-server)")
        self.maxmemory = maxmemory
        self.policy = policy
        self.extra_args = tuple(extra_args)  # e.g. ("--requirepass", ...) for the auth tests
        self.tls = tls
        super().__init__(port)

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        ports = (["--port", "0", "--tls-port", str(self.port), *self.tls.args()] if self.tls
                 else ["--port", str(self.port)])
        return [self.binary, *ports, "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self.workdir,
                "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy,
                "--maxmemory-samples", "10",  # a closer LRU than the default 5 samples
                "--daemonize", "no", *self.extra_args]

    def answers(self) -> bool:
        """Whether the server replies to PING now (asking for a password counts)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                sock = (self.tls.client_context().wrap_socket(raw, server_hostname="127.0.0.1")
                        if self.tls else raw)
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:  # (ssl.SSLError included)
            return False
