"""KeyspaceFeed: other engines' writes and the server's deletions, from keyspace notifications.

Valkey/Redis publish an event on ``__keyspace@<db>__:<key name>`` for every change to a key
when ``notify-keyspace-events`` asks for it. The tier subscribes to the pattern of its own
namespace (``PSUBSCRIBE __keyspace@0__:<prefix><namespace>:*``: the server filters, so other
namespaces' traffic never reaches us) on every server that holds keys (each primary of a
Cluster: notifications are node-local), and each poll of its refresher thread applies at
most ``events_per_poll`` events per server to the view: ``set`` adopts the key (any
writer's ``SET NX``), ``del``, ``expired`` and ``evicted`` drop it. A lookup therefore finds
a key another engine wrote within one ``refresh_interval_s`` (plus the backlog beyond
``events_per_poll``), and the cost of a poll is proportional to what changed, not to the
store.

Enabling: at start, and for a server that becomes a primary later (a failover), the feed
reads ``CONFIG GET notify-keyspace-events`` and, if the flags it needs (``K`` keyspace
channel, ``$`` string, ``g`` generic, ``x`` expired, ``e`` evicted) are not all set, adds
them with ``CONFIG SET`` (keeping the flags already there: other clients may rely on them).
A server that refuses ``CONFIG`` (an ACL without ``+config``, a managed service that
renamed it) or ``PSUBSCRIBE`` on our pattern (an ACL's channels; ACLs match a pattern
literally: the user needs ``allchannels`` or exactly our pattern) is not subscribed: the
tier says so once, at start, and relies on the paced crawl (crawl.py) for that server.

Pub/sub is at most once: events sent while the subscription was down (a reconnect, a server
that cut us off past its ``client-output-buffer-limit pubsub``, a restart) are lost. That is
what the crawl reconciles; a lost subscription counts ``feed_gaps`` and is one warning per
episode (its own ``Outage``, not the I/O path's: a feed problem never fails a job), and
the server is enabled and subscribed again from scratch at the next poll its ``Outage``
lets through (a restarted server forgot the ``CONFIG SET``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from redis.exceptions import ResponseError

from kv_offload.backends.common.deadline import request_deadline
from kv_offload.backends.common.jobs import JobBook
from kv_offload.backends.common.outage import Outages
from kv_offload.backends.common.pacing import Pacer, let_others_run
from kv_offload.backends.common.server_keys import ServerKeys
from kv_offload.backends.valkey.config import ValkeyTierConfig
from kv_offload.backends.valkey.connection import SERVER_ERRORS, SINGLE, ValkeyConnection

logger = logging.getLogger(__name__)

NEEDED_FLAGS = "K$gxe"  # keyspace channel; string, generic, expired and evicted events
ALL_EVENTS = "g$lshzxetd"  # what the flag "A" stands for
ADDED = frozenset({b"set"})
REMOVED = frozenset({b"del", b"expired", b"evicted", b"unlink"})


@dataclass
class _Subscription:
    """One server's pattern subscription."""

    pubsub: object  # redis-py PubSub


class KeyspaceFeed:
    """Keyspace notifications of the tier's keys, on every primary (see the docstring)."""

    def __init__(self, config: ValkeyTierConfig, conn: ValkeyConnection, view: ServerKeys,
                 book: JobBook, *, namespace: bytes, match: bytes,
                 key_of: Callable[[bytes], bytes | None]) -> None:
        self._config = config
        self._conn = conn
        self._view = view
        self._book = book
        self._key_of = key_of
        self._channel = f"__keyspace@{_database(config.url)}__:".encode()
        self._pattern = self._channel + match
        self._cut = len(self._channel)
        self._subscribed: dict[str, _Subscription] = {}
        self._refused: set[str] = set()  # servers that refused CONFIG: crawl only
        self._outages = Outages(f"keyspace notifications of {config.display_url}",
                                config.retry_interval_s, logger,
                                "other engines' writes there are found by the paced SCAN only")
        self.enabled = config.keyspace_events

    def start(self) -> None:
        """Subscribe on every primary (enabling the events where needed); a server that
        refuses is said once (at start, or when it first answers)."""
        if self.enabled:
            self._follow_topology()

    @property
    def subscribed(self) -> int:
        """How many servers the feed listens to now."""
        return len(self._subscribed)

    def poll(self) -> int:
        """Apply at most ``events_per_poll`` events per server; returns how many."""
        if not self.enabled:
            return 0
        self._follow_topology()
        total = 0
        for name, sub in list(self._subscribed.items()):
            outage = self._outage(name)
            if not outage.should_try():
                continue
            try:
                total += self._drain(sub)
                outage.succeeded()
            except ResponseError as e:  # (e.g. NOPERM on the channel pattern, from the ACL)
                _close(self._subscribed.pop(name))
                self._refuse(name, e)
            except SERVER_ERRORS as e:
                if not outage.down:
                    self._book.count("feed_gaps")  # (events lost until it re-subscribes)
                outage.failed(e)
                # Subscribed again from scratch at a later poll: a restarted server has
                # lost our CONFIG SET too (redis-py's own re-subscription would not redo it).
                _close(self._subscribed.pop(name))
        return total

    def close(self) -> None:
        for sub in self._subscribed.values():
            _close(sub)
        self._subscribed.clear()

    # -- internals -------------------------------------------------------------------------

    def _drain(self, sub: _Subscription) -> int:
        latest: dict[bytes, bool] = {}  # key -> present after its last event (in order)
        count = 0
        with Pacer(let_others_run) as pacer:
            while count < self._config.events_per_poll:
                message = sub.pubsub.get_message(ignore_subscribe_messages=True, timeout=0.0)
                if message is None:
                    break
                count += 1
                if message.get("type") != "pmessage":
                    continue
                event, name = message["data"], message["channel"][self._cut:]
                if event in ADDED or event in REMOVED:
                    key = self._key_of(name)
                    if key is not None:
                        latest[key] = event in ADDED
                pacer.tick()
        self._view.add(k for k, present in latest.items() if present)
        self._view.discard(k for k, present in latest.items() if not present)
        self._book.count("feed_events", n=count)
        return count

    def _follow_topology(self) -> None:
        """Subscribe to primaries not yet subscribed (a failover promoted a replica); drop
        servers that are no longer primaries."""
        primaries = {(SINGLE if n is None else n.name): n for n in self._conn.primaries()}
        for gone in set(self._subscribed) - set(primaries):
            _close(self._subscribed.pop(gone))
        for name, node in primaries.items():
            if name in self._subscribed or name in self._refused:
                continue
            outage = self._outage(name)
            if not outage.should_try():
                continue
            client = self._conn.client if node is None else node.redis_connection
            try:
                with request_deadline(self._config.request_timeout_s):
                    refusal = self._enable(client)
                    if refusal is not None:
                        self._refuse(name, refusal)
                        continue
                    pubsub = client.pubsub(ignore_subscribe_messages=True)
                    pubsub.psubscribe(self._pattern)
                self._subscribed[name] = _Subscription(pubsub)
                outage.succeeded()
            except ResponseError as e:  # PSUBSCRIBE refused (the ACL's channels)
                self._refuse(name, e)
            except SERVER_ERRORS as e:
                outage.failed(e)  # (down: the crawl covers it; retried at a later poll)

    def _outage(self, name: str):
        return self._outages.of(name, f"keyspace notifications of {self._config.display_url}"
                                if name == SINGLE else None)

    def _refuse(self, name: str, error: BaseException) -> None:
        self._refused.add(name)
        self._book.count("feed_refused")
        logger.warning(
            "kv-offload: the Valkey server %s%s refused the tier's keyspace notifications "
            "(%s); keys other engines write there are found by the paced SCAN only, within "
            "one pass over its keys (refresh_interval_s, scan_count, scan_pages_per_refresh); "
            "to be told at once, allow the user +config|get +config|set +psubscribe and "
            "allchannels, or set notify-keyspace-events to include %r and allow PSUBSCRIBE",
            self._config.display_url, "" if name == SINGLE else f" (cluster node {name})",
            error, NEEDED_FLAGS)

    def _enable(self, client) -> BaseException | None:
        """Make sure the server publishes the events the feed needs; the error if it
        refuses (None: done)."""
        try:
            current = client.config_get("notify-keyspace-events").get(
                "notify-keyspace-events", "")
            have = set(current.replace("A", ALL_EVENTS))
            missing = "".join(f for f in NEEDED_FLAGS if f not in have)
            if missing:
                client.config_set("notify-keyspace-events", current + missing)
        except ResponseError as e:  # NOPERM, or CONFIG renamed/disabled
            return e
        except (AttributeError, TypeError, ValueError) as e:  # a reply no Valkey sends
            return e
        return None


def _database(url: str) -> int:
    """The database number of ``url`` (``/DB``; ``?db=N`` for a unix socket; default 0)."""
    parts = urlsplit(url)
    db = (parse_qs(parts.query).get("db", [""])[0] if parts.scheme == "unix"
          else parts.path.strip("/"))
    return int(db) if db.isdigit() else 0


def _close(sub: _Subscription) -> None:
    with contextlib.suppress(Exception):  # (closing: nothing left to report to)
        sub.pubsub.close()
