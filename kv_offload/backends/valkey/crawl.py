"""The Valkey tier's SCANs: the whole keyspace at start, then a crawl bounded per poll.

Contents:
- `ServerCrawl.full()` SCANs every server whole now (start-up, ``ValkeyTier.refresh``):
  keys others wrote are adopted, keys gone are dropped.
- `ServerCrawl.poll()` runs ``scan_pages_per_refresh`` SCAN calls (``COUNT scan_count``) on
  each primary, resuming each primary's cursor where the last poll left it; called every
  ``refresh_interval_s`` by the tier's refresher thread.

Why: the tier used to SCAN the whole keyspace every 5 s on its refresher thread, inside the
engine's process: at a million keys, seconds of CPU per refresh and one lock held for the
whole merge (0.5 s at 300k keys), competing with the engine for its cores and its
interpreter lock. The keyspace notifications (feed.py) now tell the tier of other engines'
writes and of deletions within a poll; the crawl only reconciles what they missed (a
subscription lost for a while, a server refusing ``CONFIG SET``, a restart), so it can be
slow and cheap.

How a pass reconciles, at a bounded cost:
- Each primary has its own pass (a cursor and the scan generation it began in, see
  common/server_keys.py). The names of each page are adopted at once (``ServerKeys.confirm``) and
  stamped with the pass's generation. When the cursor comes back to 0 the pass is complete:
  the keys of that primary that predate the pass and that it did not see are dropped
  (``ServerKeys.drop_unseen``, in paced steps), and the next poll starts a new pass.
- Delay: a key the notifications missed is adopted within one pass of its primary,
  ``ceil(keys on that server / (scan_count * scan_pages_per_refresh)) * refresh_interval_s``
  (SCAN's COUNT counts the server's keys, ours or not).
- Cost per poll: ``scan_pages_per_refresh`` requests per primary, each bounded by
  ``request_timeout_s``; the names are decoded in paced steps (~0.25 ms each), so the
  engine's thread is not kept from the interpreter lock.
- A failed page (its primary's ``Outage``) leaves the pass where it was; a primary that
  is no longer one (a failover) loses its pass, and the new primary starts its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from kv_offload.backends.common.deadline import request_deadline
from kv_offload.backends.common.jobs import JobBook
from kv_offload.backends.common.outage import Outages
from kv_offload.backends.common.pacing import Pacer, let_others_run
from kv_offload.backends.common.server_keys import ServerKeys
from kv_offload.backends.valkey.config import ValkeyTierConfig
from kv_offload.backends.valkey.connection import SERVER_ERRORS, SINGLE, ValkeyConnection


@dataclass
class _Pass:
    """One pass of the crawl over one primary, in progress."""

    generation: int
    cursor: int = 0


class ServerCrawl:
    """SCANs of the tier's keys on every primary: whole (``full``) or paced (``poll``)."""

    def __init__(self, config: ValkeyTierConfig, conn: ValkeyConnection, view: ServerKeys,
                 outages: Outages, book: JobBook, *, match: bytes,
                 key_of: Callable[[bytes], bytes | None], name_of: Callable[[bytes], bytes],
                 stopping: threading.Event) -> None:
        self._config = config
        self._conn = conn
        self._view = view
        self._outages = outages
        self._book = book
        self._match = match
        self._key_of = key_of
        self._name_of = name_of
        self._stopping = stopping  # set when the tier closes: an unfinished scan drops nothing
        self._lock = threading.Lock()  # one scan at a time
        self._passes: dict[str, _Pass] = {}  # primary's name -> its pass in progress

    def full(self) -> bool:
        """SCAN every primary whole now; False if one could not be scanned (its keys are
        then not known gone: new keys are adopted, none dropped)."""
        with self._lock:
            self._passes.clear()  # (abandoned: this one covers them)
            generation = self._view.begin_scan()
            found: list[bytes] = []
            complete = True
            for node in self._conn.primaries():
                outage = self._outages.of(_name(node))
                if not outage.should_try():
                    complete = False
                    continue
                try:
                    cursor = None
                    while cursor != 0:
                        if self._stopping.is_set():
                            return False  # closing: an unfinished scan must not drop anything
                        with request_deadline(self._config.request_timeout_s):
                            cursor, names = self._conn.scan_page(
                                node, cursor or 0, self._match, self._config.scan_count)
                        found += [k for k in map(self._key_of, names) if k is not None]
                    outage.succeeded()
                except SERVER_ERRORS as e:
                    outage.failed(e)
                    complete = False
            if not complete:
                self._view.add(found)
                return False
            added, dropped = self._view.merge_scan(found, generation)
            self._book.count("keys_adopted", n=added)
            self._book.count("keys_vanished", n=dropped)
            return True

    def poll(self) -> None:
        """The next ``scan_pages_per_refresh`` pages of each primary's pass."""
        with self._lock:
            primaries = {_name(node): node for node in self._conn.primaries()}
            for gone in set(self._passes) - set(primaries):
                del self._passes[gone]  # (no longer a primary: its keys moved with its slots)
            for name, node in primaries.items():
                if self._stopping.is_set():
                    return
                self._poll_node(name, node)

    def _poll_node(self, name: str, node) -> None:
        outage = self._outages.of(name)
        if not outage.should_try():
            return
        current = self._passes.get(name)
        if current is None:
            current = self._passes[name] = _Pass(self._view.begin_scan())
        try:
            for _ in range(self._config.scan_pages_per_refresh):
                with request_deadline(self._config.request_timeout_s):
                    cursor, names = self._conn.scan_page(node, current.cursor, self._match,
                                                         self._config.scan_count)
                self._book.count("scan_pages")
                self._adopt(names, current.generation)
                current.cursor = cursor
                if cursor == 0:
                    self._finish(name, current)
                    break
            outage.succeeded()
        except SERVER_ERRORS as e:
            outage.failed(e)  # (the pass stays where it was: the next poll resumes it)

    def _adopt(self, names: list, generation: int) -> None:
        """Decode and confirm a page's names in steps of ~0.25 ms."""
        names_left = iter(names)
        with Pacer(let_others_run) as pacer:
            while chunk := list(islice(names_left, 64)):
                keys = [k for k in map(self._key_of, chunk) if k is not None]
                self._book.count("keys_adopted", n=self._view.confirm(keys, generation))
                pacer.tick(len(chunk))

    def _finish(self, name: str, current: _Pass) -> None:
        """A primary's pass is complete: drop its keys that the pass did not see."""
        del self._passes[name]
        if self._conn.cluster:  # (keys of other primaries are judged by their own passes)
            def elsewhere(key: bytes) -> bool:
                return self._conn.node_of(self._name_of(key)) != name
        else:
            def elsewhere(key: bytes) -> bool:
                return False
        self._book.count("keys_vanished", n=self._view.drop_unseen(elsewhere, current.generation))
        self._book.count("scan_passes")


def _name(node) -> str:
    return SINGLE if node is None else node.name
