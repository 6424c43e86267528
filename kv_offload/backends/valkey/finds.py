"""The Valkey tier's targeted question: does the server hold these keys now?

Why: the tier's view learns of other engines' writes from keyspace notifications and a paced
SCAN, both polled by the refresher thread every ``refresh_interval_s`` (and the crawl takes
a pass over the whole keyspace to find what the notifications missed). A decode server
waiting for the blocks its prefill server just stored, or any server that must see another's
blocks within a second, knows exactly which keys it needs: one ``EXISTS`` per key answers
it at a cost proportional to the request, not to the store.

How: the keys are grouped by the server that holds them (one group on a single server, one
per primary of a Cluster, by key slot from redis-py's slot table, as jobs are grouped), and
each group is one pipelined round trip. The whole call runs under one request deadline
(``request_timeout_s``), whatever the number of servers. Keys a server holds are adopted into
the view (``ServerKeys.add``, as a ``set`` notification adopts them: ``lookup`` and
``take_changes`` see them). A server in an outage (its ``Outage`` says wait, or it fails now)
is not asked: its keys are answered from the view, and a failure opens its episode as a
failed job would. Nothing raises for a server's fault.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kv_offload.backends.common.deadline import request_deadline
from kv_offload.backends.common.jobs import JobBook
from kv_offload.backends.common.outage import Outages
from kv_offload.backends.common.server_keys import ServerKeys
from kv_offload.backends.valkey.config import ValkeyTierConfig
from kv_offload.backends.valkey.connection import (
    SERVER_ERRORS,
    ValkeyConnection,
)

logger = logging.getLogger("kv_offload.backends.valkey.tier")  # (the tier's log lines)


class ValkeyFinds:
    """Answers ``ValkeyTier.find`` (its config, connection, outages, book and view)."""

    def __init__(self, config: ValkeyTierConfig, conn: ValkeyConnection, outages: Outages,
                 book: JobBook, view: ServerKeys, name_of: Callable[[bytes], bytes]) -> None:
        self._config = config
        self._conn = conn
        self._outages = outages
        self._book = book
        self._view = view
        self._name_of = name_of

    def find(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is on its server now (the view's answer where the server could
        not be asked); the keys found are adopted into the view."""
        answers = self._view.contains(keys)
        self._book.count("finds")
        self._book.count("find_keys", n=len(keys))
        # (a server not yet known to be single or cluster: no slot table to group by; the
        # refresher settles it)
        if not keys or not self._conn.decided or self._book.closed:
            return answers
        try:
            groups = self._by_server(keys)
        except SERVER_ERRORS:  # (no slot table now: a cluster between primaries)
            return answers
        held: list[bytes] = []
        with request_deadline(self._config.request_timeout_s):  # (the whole call)
            for server, positions in groups.items():
                found = self._ask(server, [keys[i] for i in positions])
                for i, here in zip(positions, found or ()):
                    if here is not None:
                        answers[i] = here
                        if here:
                            held.append(keys[i])
        before = self._view.contains(held)
        self._view.add(held)
        self._book.count("find_adopted", n=before.count(False))
        return answers

    def _by_server(self, keys: Sequence[bytes]) -> dict[str, list[int]]:
        """Positions of ``keys`` by the name of the server holding them (no network)."""
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self._conn.node_of(self._name_of(key)), []).append(i)
        return groups

    def _ask(self, server: str, keys: list[bytes]) -> list[bool | None] | None:
        """One pipelined round trip of ``EXISTS`` to one server: per key, whether it holds
        it (None: refused, e.g. an ACL); None for all when the server was not asked or
        failed (its Outage says so)."""
        outage = self._outages.of(server)
        if not outage.should_try():
            return None
        try:
            replies = self._conn.pipelined(
                lambda pipe: [pipe.exists(self._name_of(key)) for key in keys])
            outage.succeeded()
        except SERVER_ERRORS as e:
            outage.failed(e)
            self._book.count("find_failed_unreachable", n=len(keys))
            return None
        except Exception:  # (a bug must not reach the worker: the view answers)
            self._book.count("find_failed_bug", n=len(keys))
            logger.exception("kv-offload: unexpected error asking %s for keys",
                             self._config.display_url)
            return None
        found: list[bool | None] = []
        for reply in replies:
            if isinstance(reply, Exception):
                self._book.count("find_failed_refused")
                self._book.note("find-refused", "%s refused EXISTS: %s",
                                self._config.display_url, reply)
                found.append(None)
            else:
                found.append(bool(reply))
        return found
