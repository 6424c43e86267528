"""A throwaway Valkey/Redis Cluster on loopback, for tests and `kv-offload bench`.

Starts ``primaries * (1 + replicas)`` servers (``LocalServer``s with ``cluster-enabled yes``,
so they die with the process that started them, as every loopback server here does), joins
them with ``redis-cli --cluster create ... --cluster-replicas N --cluster-yes`` (or
``valkey-cli``), and waits until every node says ``cluster_state:ok`` and every replica has
synced with its primary: only then can a replica take over a killed primary.
``cluster-node-timeout`` is small (1 s by default) so that a failover takes a few seconds.

Cluster ports need their bus port (port + 10000) free too, below 65536: ports are chosen
here, not by the kernel's ephemeral range.
"""

from __future__ import annotations

import random
import re
import socket
import subprocess
import time

from kv_offload.backends.common.local_process import first_on_path
from kv_offload.backends.valkey.local_server import LocalServer, ServerTls

CLIS = ("valkey-cli", "redis-cli")
BUS_OFFSET = 10000  # the cluster bus listens on port + 10000


def cli_binary() -> str | None:
    return first_on_path(CLIS)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port(taken: set[int]) -> int:
    """A port whose bus port is free too (both below 65536)."""
    for _ in range(1000):
        port = random.randint(20000, 29999)
        if port not in taken and _bindable(port) and _bindable(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a cluster node on 127.0.0.1")


class LocalCluster:
    """A cluster of ``primaries`` primaries with ``replicas`` replicas each, on 127.0.0.1
    (a context manager: every node stopped on exit)."""

    def __init__(self, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000,
                 maxmemory: str = "64mb", extra_args: tuple[str, ...] = (),
                 start_timeout_s: float = 30.0, tls: ServerTls | None = None) -> None:
        cli = cli_binary()
        if cli is None:
            raise FileNotFoundError(f"none of {CLIS} is on PATH (Debian: apt-get install -y "
                                    f"redis-server, which brings redis-cli)")
        self.nodes: list[LocalServer] = []
        self.tls = tls  # (TLS between nodes too: --tls-cluster, --tls-replication)
        tls_args = ("--tls-cluster", "yes", "--tls-replication", "yes") if tls else ()
        try:
            taken: set[int] = set()
            for _ in range(primaries * (1 + replicas)):
                port = free_cluster_port(taken)
                taken.add(port)
                self.nodes.append(LocalServer(
                    maxmemory=maxmemory, port=port,
                    extra_args=("--cluster-enabled", "yes", "--cluster-config-file",
                                "nodes.conf", "--cluster-node-timeout", str(node_timeout_ms),
                                *tls_args, *extra_args), tls=tls))
            create = subprocess.run(
                [cli, *self._cli_tls(), "--cluster", "create",
                 *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", str(replicas), "--cluster-yes"],
                capture_output=True, text=True, timeout=start_timeout_s)
            if create.returncode != 0:
                raise RuntimeError(f"{cli} --cluster create failed: "
                                   f"{(create.stdout + create.stderr)[-2000:]}")
            self.wait_until_ready(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """The URL of one node (any node will do: the client discovers the others)."""
        return self.nodes[0].url

    def _cli_tls(self) -> list[str]:
        if self.tls is None:
            return []
        return ["--tls", "--cacert", self.tls.ca_file, "--cert", self.tls.client_cert_file,
                "--key", self.tls.client_key_file]

    def alive(self) -> list[LocalServer]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def client(self, node: LocalServer):
        import redis

        tls = ({} if self.tls is None else {
            "ssl": True, "ssl_ca_certs": self.tls.ca_file,
            "ssl_certfile": self.tls.client_cert_file, "ssl_keyfile": self.tls.client_key_file})
        return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=2, **tls)

    def primary_of(self, name: bytes) -> LocalServer:
        """The node that serves ``name``'s slot now."""
        for node in self.alive():
            with self.client(node) as c:
                slot = c.execute_command("CLUSTER", "KEYSLOT", name)
                for start, end, (_host, port, *_), *_ in c.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        return next(n for n in self.nodes if n.port == port)
        raise RuntimeError("no live node answers CLUSTER SLOTS")

    def primaries(self) -> list[LocalServer]:
        return [n for n in self.alive() if self._role(n) == "master"]

    def _role(self, node: LocalServer) -> str:
        with self.client(node) as c:
            return c.info("replication")["role"]

    def ready(self) -> bool:
        """Every live node says cluster_state:ok, every slot is served by a live primary,
        and every live replica's link to its primary is up."""
        import redis

        try:
            for node in self.alive():
                with self.client(node) as c:
                    if b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                        return False
                    info = c.info("replication")
                    if info["role"] == "slave" and info.get("master_link_status") != "up":
                        return False
                    live = {n.port for n in self.alive()}
                    if any(port not in live for _, _, (_, port, *_), *_ in
                           c.execute_command("CLUSTER", "SLOTS")):
                        return False
        except (OSError, redis.RedisError):  # a node still starting, or just killed
            return False
        return True

    def wait_until_ready(self, timeout_s: float = 30.0) -> float:
        """Wait until ``ready`` (after a start, or a failover); returns the seconds waited."""
        start = time.monotonic()
        while not self.ready():
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"the cluster was not ready within {timeout_s} s: "
                                   f"{[n.log_tail(500) for n in self.alive()]}")
            time.sleep(0.1)
        return time.monotonic() - start

    def wait_for_replicas(self, primary: LocalServer, timeout_s: float = 30.0) -> float:
        """Wait until every replica of ``primary`` has acknowledged all it has written
        (replication is asynchronous: a primary killed right after a write loses what its
        replica has not received yet); returns the seconds waited."""
        start = time.monotonic()
        while True:
            with self.client(primary) as c:
                info = c.info("replication")
            wrote = int(info["master_repl_offset"])
            replicas = [v for k, v in info.items() if re.fullmatch(r"slave\d+", k)]
            if replicas and all(int(r["offset"]) >= wrote for r in replicas):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"the replicas of 127.0.0.1:{primary.port} did not reach "
                                   f"its offset {wrote} within {timeout_s} s: {replicas}")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
