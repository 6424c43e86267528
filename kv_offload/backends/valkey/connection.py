"""How the Valkey tier reaches its store: one server or a Cluster, over TCP, TLS or a socket.

``storage_options.url`` names one server. ``ValkeyConnection.open`` connects to it with a
plain redis-py client, checks the credentials, and asks ``INFO cluster`` whether it is a
Cluster node; if so it switches to redis-py's ``RedisCluster`` client, which discovers the
other nodes, maps keys to slots and slots to primaries, follows ``MOVED``/``ASK`` and
re-reads the topology when a node fails (its cluster pipeline sends each node's commands
in one round trip). Then it runs every command the tier needs once, on a probe key of the
tier's namespace, so that an ACL that denies one (or a key pattern that excludes ours) is a
``ConfigError`` at start naming the command, not one refused reply per batch for ever.

A server that cannot be reached at start is not an error (the tier starts with misses):
the connection stays a single-server one, undecided, and ``settle`` (each background
refresh) asks again once the server answers.

Every client here is bounded the same way: ``timeout_s`` per socket wait, the thread's
request deadline (common/deadline.py) over a whole request, no retries inside redis-py (a retry
would double every wait; the tier's ``Outage`` decides when to try again). Values go out
through the tier's zero-copy packer (packer.py) in both modes: the cluster client takes no
``command_packer``, so the connection class carries it.

A pipeline (``pipelined``) that loses a cluster node's connection mid-flight runs once more:
when another I/O thread meets a ``MOVED`` (a reshard, a failover), redis-py re-reads the slot
table and drops the pooled connections of the node it asked, in use or not, so a batch in
flight there fails with "Connection closed by server" (or, a redis-py race, with its socket
already gone) although every node answers. Once more on fresh connections and the new slot
table costs a round trip; a timeout is never repeated (that would double the wait on a
stalled node).

Which server a key lives on (``node_of``) and which servers hold keys (``primaries``) come
from redis-py's slot table: no network call.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import (
    ClusterError,
    NoPermissionError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.retry import Retry

from kv_offload.backends.common.deadline import deadline_connection_class, request_deadline
from kv_offload.backends.valkey.config import ValkeyTierConfig
from kv_offload.errors import ConfigError

# Errors that say a server is unreachable, stalled or between primaries (not that one
# command was refused): the keys are misses and the server's Outage opens.
# (RedisClusterException: the cluster client found no node it could reach.)
SERVER_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError, ClusterError,
                 SlotNotCoveredError, TryAgainError, RedisClusterException)
SINGLE = "server"  # the one node name of a single-server connection
# How a connection that redis-py's cluster client dropped under another thread fails inside
# redis-py (see the module's docstring): a ConnectionError, or its socket already None
# (``'NoneType' object has no attribute 'sendall'``, a TypeError from its readiness poll).
# Only ever caught around redis-py's own calls, on a cluster, and tried once more.
DROPPED_UNDER_US = (redis.ConnectionError, AttributeError, TypeError)


def raise_server_error(replies: list) -> None:
    """A pipeline run with ``raise_on_error=False`` returns errors as replies; the cluster
    pipeline returns a node's connection failure that way too: raise it as one."""
    failure = next((r for r in replies if isinstance(r, SERVER_ERRORS)), None)
    if failure is not None:
        raise failure


class ValkeyConnection:
    """The tier's redis-py client (``client``: a ``Redis`` or a ``RedisCluster``)."""

    def __init__(self, config: ValkeyTierConfig, packer, namespace: bytes) -> None:
        self.config = config
        self.cluster = False
        self.decided = False  # whether the server said if it is a cluster node
        self._packer = packer
        self._probe = namespace + b"access-check"  # (not hex: never taken for a key)
        self.client = self._single_client()

    # -- start-up ------------------------------------------------------------------------

    def open(self) -> None:
        """Check credentials, TLS, cluster mode and permissions now; ``ConfigError`` if
        the server refuses us. An unreachable server is left for ``settle``."""
        try:
            with request_deadline(self.config.request_timeout_s):
                self.client.ping()
        except redis.AuthenticationError as e:  # (WRONGPASS, NOAUTH; holds no password)
            self.close()
            raise ConfigError(
                f"the Valkey server at {self.config.display_url} refused the credentials "
                f"(username {self.config.credentials().get('username', 'default')!r}, "
                f"password from storage_options.password_file "
                f"{self.config.password_file!r}): {e}") from None
        except redis.ConnectionError as e:
            if _tls_failure(e):
                self.close()
                raise ConfigError(
                    f"the TLS handshake with the Valkey server at {self.config.display_url} "
                    f"failed (storage_options.tls_ca_file {self.config.tls_ca_file!r}, "
                    f"tls_cert_file {self.config.tls_cert_file!r}): {e}") from None
            return  # down: the first refresh opens an outage episode, settle() decides later
        except ResponseError as e:  # (e.g. SELECT of a database on a cluster node)
            if isinstance(e, ClusterError | TryAgainError):
                return  # (between primaries: an outage, not a refusal)
            self.close()
            hint = (" (a Valkey Cluster has only database 0: drop the database number from "
                    "storage_options.url)" if "cluster" in str(e) else "")
            raise ConfigError(f"the Valkey server at {self.config.display_url} refused the "
                              f"connection set-up: {e}{hint}") from None
        except SERVER_ERRORS:
            return
        try:
            self._decide()
        except SERVER_ERRORS:  # (stalled mid-check: settle() asks again)
            pass
        except ConfigError:
            self.close()
            raise

    def settle(self) -> None:
        """If start-up could not tell whether the server is a cluster node (or check the
        commands), ask again (the caller's Outage lets this through once it answers)."""
        if not self.decided:
            try:
                self._decide()
            except ConfigError as e:  # (too late to refuse the start: say why it fails)
                raise redis.ConnectionError(str(e)) from None

    def _decide(self) -> None:
        with request_deadline(self.config.request_timeout_s):
            info = self._checked("INFO cluster", lambda: self.client.info("cluster"))
        if int(info.get("cluster_enabled", 0)) and not self.cluster:
            self._become_cluster()
        self._check_commands()
        self.decided = True

    def _become_cluster(self) -> None:
        parts = urlsplit(self.config.url)
        where = self.config.display_url
        if parts.scheme == "unix":
            raise ConfigError(f"{where} is a Valkey Cluster node, but a cluster is reached "
                              f"over TCP: give storage_options.url as redis://HOST:PORT (or "
                              f"rediss://) of any node")
        if parts.path.strip("/") not in ("", "0"):
            raise ConfigError(f"{where} is a Valkey Cluster node, and a cluster has only "
                              f"database 0: drop /{parts.path.strip('/')} from "
                              f"storage_options.url")
        from redis.cluster import RedisCluster

        # A redis:// URL even for TLS: a rediss:// one would make redis-py replace the
        # connection class below (and its deadline-bounded sockets) with its own.
        node = f"redis://{parts.hostname}:{parts.port or 6379}"
        with request_deadline(self.config.request_timeout_s):
            try:
                cluster = RedisCluster.from_url(
                    node, retry=Retry(NoBackoff(), 0), require_full_coverage=False,
                    connection_pool_class=redis.BlockingConnectionPool,
                    **self._pool_options())
            except NoPermissionError as e:
                raise ConfigError(f"the Valkey Cluster at {where} refused user "
                                  f"{self._user()!r} a command the cluster client needs to "
                                  f"learn the topology (its ACL must allow +cluster|slots "
                                  f"+command): {e}") from None
        self.client.connection_pool.disconnect()
        self.client, self.cluster = cluster, True

    def _check_commands(self) -> None:
        """Run each command the tier uses once; an ACL that refuses one is a ConfigError."""
        probe, client = self._probe, self.client
        with request_deadline(self.config.request_timeout_s):
            self._checked("SET", lambda: client.set(probe, b"", nx=True, px=10_000))
            for name, call in (("EXISTS", lambda: client.exists(probe)),
                               ("STRLEN", lambda: client.strlen(probe)),
                               ("GETRANGE", lambda: client.getrange(probe, 0, 0)),
                               ("GET", lambda: client.get(probe)),
                               ("SCAN", lambda: self.scan_page(self.primaries()[0], 0,
                                                               probe, 1)),
                               ("INFO memory", lambda: client.info("memory")),
                               ("UNLINK", lambda: client.unlink(probe))):
                self._checked(name, call)

    def _checked(self, name: str, call):
        try:
            return call()
        except ResponseError as e:  # NOPERM (ACL), or a command renamed/disabled
            if isinstance(e, ClusterError | TryAgainError):
                raise
            raise ConfigError(
                f"the Valkey server at {self.config.display_url} refused {name} to user "
                f"{self._user()!r}, which the tier needs (its ACL must allow +@read "
                f"+@write +@keyspace +info +scan on keys {self.config.key_prefix}*, or "
                f"the command is disabled): {e}") from None

    def _user(self) -> str:
        return self.config.credentials().get("username", "default")

    # -- clients -------------------------------------------------------------------------

    def _pool_options(self) -> dict:
        config = self.config
        base = deadline_connection_class(config.url)
        packer = self._packer
        # The packer through the class: RedisCluster drops a command_packer argument.
        connection_class = base if packer is None else type(
            f"Packing{base.__name__}", (base,),
            {"__init__": lambda self, **kw: base.__init__(self, **{
                "command_packer": packer, **kw})})
        return {
            # + the refresh thread, + clear(), + the keyspace notifications' subscription,
            # + find() (the worker's thread)
            "max_connections": config.connections + 4,
            "timeout": config.timeout_s,  # waiting for a free connection is bounded too
            "socket_timeout": config.timeout_s,
            "socket_connect_timeout": config.connect_timeout_s,
            "connection_class": connection_class,
            **config.tls(),
            **config.credentials(),  # (never logged: straight into the client)
        }

    def _single_client(self) -> redis.Redis:
        pool = redis.BlockingConnectionPool.from_url(
            self.config.url, retry=Retry(NoBackoff(), 0), health_check_interval=0,
            **self._pool_options())
        return redis.Redis(connection_pool=pool)

    # -- commands ------------------------------------------------------------------------

    def pipelined(self, queue: Callable[[Any], None]) -> list:
        """The replies of one non-transactional pipeline whose commands ``queue`` adds (a
        refused command is its reply; a server error raises). On a cluster, a connection
        dropped mid-pipeline runs it once more (see the module's docstring): every command
        queued here must be safe to repeat (reads, ``EXISTS``, ``SET NX``)."""
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=False)
            queue(pipe)
            try:
                replies = pipe.execute(raise_on_error=False)
                raise_server_error(replies)
                return replies
            except DROPPED_UNDER_US:  # (not a redis.TimeoutError: not a subclass)
                if attempt == 2 or not self.cluster:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    # -- topology ------------------------------------------------------------------------

    def node_of(self, name: bytes) -> str:
        """The name of the server holding ``name`` (from the slot table: no network)."""
        if not self.cluster:
            return SINGLE
        return self.client.get_node_from_key(name).name

    def pool_of(self, names: list[bytes]):
        """redis-py's connection pool of the one server holding every key of ``names`` (from
        the slot table: no network), or None if they are not on one known node now."""
        if not self.cluster:
            return self.client.connection_pool
        try:
            node = self.client.get_node_from_key(names[0])
            if any(self.client.get_node_from_key(n).name != node.name for n in names[1:]):
                return None
            return self.client.get_redis_connection(node).connection_pool
        except (SlotNotCoveredError, RedisClusterException, AttributeError):  # (None: no node)
            return None

    def primaries(self) -> list:
        """The servers that hold keys: ``[None]`` (the one server), or the cluster's
        primaries as redis-py knows them now."""
        return self.client.get_primaries() if self.cluster else [None]

    def scan_page(self, node, cursor: int, match: bytes, count: int) -> tuple[int, list]:
        """One SCAN page of one server (``node`` from ``primaries``)."""
        if node is None:
            return self.client.scan(cursor, match=match, count=count)
        cursors, names = self.client.scan(cursor, match=match, count=count, target_nodes=node)
        return cursors[node.name], names

    def memory(self) -> tuple[int, int]:
        """(used_memory, maxmemory), summed over the primaries."""
        if not self.cluster:
            replies = [self.client.info("memory")]
        else:
            replies = self.client.info("memory", target_nodes=self.client.PRIMARIES).values()
        return (sum(int(r.get("used_memory", 0)) for r in replies),
                sum(int(r.get("maxmemory", 0)) for r in replies))

    def close(self) -> None:
        with contextlib.suppress(Exception):  # (closing: nothing left to report to)
            if self.cluster:
                self.client.close()
            else:
                self.client.connection_pool.disconnect()


def _tls_failure(error: BaseException) -> bool:
    """Whether a connection error was a TLS handshake failure (wrong CA, rejected client
    certificate, name mismatch) rather than a server that is down."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ssl.SSLError | ssl.CertificateError):
            return True
        seen = seen.__cause__ or seen.__context__
    text = str(error)
    return "SSL" in text or "certificate" in text
