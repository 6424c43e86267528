"""ValkeyTier: one KV store shared by many servers, on Valkey, Redis OSS or a managed service.

- One key per block, ``<key_prefix><layout namespace>:<key hex>``; its value is a record
  (``kv_offload.backends.record``: format version, layout fingerprint, key, xxh3 checksum,
  then the data), so a value from another model, layout or library version, or damaged, is a
  miss and is deleted; never wrong bytes. With ``secret_file`` the checksum is a keyed tag
  or AES-GCM (``config.codec``, kv_offload.backends.common.sealing): a value written without the
  secret is refused the same way, counted as ``rejected_records`` and logged once per
  episode. Deleting it is what keeps ``SET NX`` from keeping a planted value for good: the
  next write after the failed read stores the real one.
- ``lookup`` answers from an in-memory ``ServerKeys`` (never the network): our own writes and
  reads, a whole ``SCAN`` at start, then every ``refresh_interval_s`` a background poll of
  the server's keyspace notifications (feed.py: other engines' writes, deletions and
  evictions, within one poll) and a few pages of a paced ``SCAN`` that reconciles what the
  notifications missed (crawl.py). No poll does work proportional to the store. ``find``
  asks the server about named keys at once (a pipelined ``EXISTS`` per key, one round trip
  per server: finds.py), for a caller that cannot wait for the next poll.
- Jobs run on ``connections`` I/O threads, split into batches of at most ``batch_bytes`` (and
  spread over the connections). Each batch is two pipelined round trips for writes (``EXISTS``
  for every key, then ``SET NX`` for the missing ones: the same key always names the same
  bytes) and one for reads (``STRLEN`` + ``GETRANGE 0 expected-1`` per key: a value of
  another size is a miss that costs at most the buffer's bytes, see common/sized_read.py).
- The server evicts on its own (``maxmemory`` + an LRU/LFU policy): a key found gone is a miss
  and leaves the view. Server down, paused or restarted: every socket wait is bounded by
  ``timeout_s``, the failed keys are misses, and for ``retry_interval_s`` later jobs fail at
  once without waiting (``Outage``); redis-py reconnects on the next call that goes through.
  One log line per episode. A whole request (a batch, a SCAN page) is bounded by
  ``request_timeout_s`` however slowly the server sends (common/deadline.py); ``close`` waits at
  most about that long for the I/O threads.
- Credentials: ``username`` and ``password_file``, TLS files (config.py); a server that
  refuses them, or an ACL that refuses a command the tier needs, is a ``ConfigError`` at
  start, not an outage (connection.py).
- Cluster: a URL naming any node of a Valkey/Redis Cluster gives redis-py's cluster client
  (connection.py). Jobs are split per primary (by key slot) and each batch is one pipeline
  to one node, with an ``Outage`` per node: jobs on a dead primary fail fast as misses
  while the others are served, and once a replica has taken over (redis-py re-reads the
  slot table after the failure), its keys go to the new primary. Notifications and the
  paced SCAN run per primary; a scan that missed a primary only adopts keys, drops none.

Values go out as header + host buffer straight to the socket (packer.py: no joined copy).
Replies are parsed by hiredis when it is installed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kv_offload.backends.base import (
    StorageTier,
    TierChanges,
    TierJobResult,
    TierStats,
    check_tier_keys,
    check_tier_request,
)
from kv_offload.backends.common.deadline import request_deadline
from kv_offload.backends.common.host_buffers import host_view
from kv_offload.backends.common.jobs import Job, JobBook
from kv_offload.backends.common.options import parse_options
from kv_offload.backends.common.outage import Outages
from kv_offload.backends.common.refresher import Refresher
from kv_offload.backends.common.rejections import Rejections
from kv_offload.backends.common.server_keys import ServerKeys
from kv_offload.backends.record import (
    CHECKSUM,
    NETWORK_ALIGN,
    RecordCodec,
    build_header,
    pack,
)
from kv_offload.backends.valkey.config import ValkeyTierConfig
from kv_offload.backends.valkey.connection import (
    SERVER_ERRORS,
    SINGLE,
    ValkeyConnection,
)
from kv_offload.backends.valkey.crawl import ServerCrawl
from kv_offload.backends.valkey.feed import KeyspaceFeed
from kv_offload.backends.valkey.finds import ValkeyFinds
from kv_offload.backends.valkey.packer import SplitValue, split_value_packer
from kv_offload.backends.valkey.reads import ValkeyReads
from kv_offload.runtime.affinity import join_our_cpus

logger = logging.getLogger(__name__)

# Read pipelines stay small: hiredis buffers a pipeline's whole reply, growing its buffer by
# reallocation, which cost 2x the client CPU per GB with four 4 MiB values per pipeline
# against one (measured on loopback). Small values still share a round trip.
READ_BATCH_BYTES = 1 << 20
MEMORY_INTERVAL_S = 5.0  # how often a background poll refreshes the server's memory figures


class ValkeyTier(StorageTier):
    """A ``StorageTier`` on a Valkey/Redis server (see the module docstring)."""

    shared = True  # every client of the server can write: secret_file or trusted_store

    def __init__(self, config: ValkeyTierConfig) -> None:
        self.config = config
        self._namespace = f"{config.key_prefix}{config.codec.namespace(config.layout_fingerprint)}:"
        self._prefix = self._namespace.encode()
        self._packer = split_value_packer()
        self._conn = ValkeyConnection(config, self._packer, self._prefix)
        self._book = JobBook("ValkeyTier", logger)
        self._outages = Outages(f"Valkey cluster at {config.display_url}",
                                config.retry_interval_s, logger)
        self._outages.of(SINGLE, f"Valkey server {config.display_url}")
        self._view = ServerKeys()
        self._rejections = Rejections(f"kv-offload Valkey tier {config.display_url}")
        self._reads = ValkeyReads(config, self._conn, self._book, self._view, self._rejections,
                                  self._name)
        self._finds = ValkeyFinds(config, self._conn, self._outages, self._book, self._view,
                                  self._name)
        self._server_memory = (0, 0)  # (used_memory, maxmemory) at the last refresh
        self._io = ThreadPoolExecutor(config.connections, thread_name_prefix="kv-valkey-io",
                                      initializer=join_our_cpus)
        self._refresher = Refresher(self._poll, config.refresh_interval_s,
                                    name="kv-valkey-refresh", what=self.config.display_url)
        self._crawl = ServerCrawl(config, self._conn, self._view, self._outages, self._book,
                                  match=self._match(), key_of=self._key_of, name_of=self._name,
                                  stopping=self._refresher.stopping)
        self._feed = KeyspaceFeed(config, self._conn, self._view, self._book,
                                  namespace=self._prefix, match=self._match(),
                                  key_of=self._key_of)
        self._memory_at = 0.0  # monotonic time of the last memory figures
        try:
            self._conn.open()  # ConfigError: refused credentials, TLS, ACL, cluster URL
        except BaseException:
            self._io.shutdown(wait=False)
            raise
        if self._conn.decided:
            self._feed.start()  # (before the scan: a write during it is not missed)
        self.refresh()  # the keys already there, before the first lookup (bounded by timeouts)
        self._refresher.start()

    @classmethod
    def check_options(cls, options) -> None:
        parse_options(ValkeyTierConfig, options, tier="valkey", layout_fingerprint="check")

    @classmethod
    def from_options(cls, options, layout_fingerprint: str, *,
                     codec: RecordCodec = CHECKSUM) -> ValkeyTier:
        return cls(parse_options(ValkeyTierConfig, options, tier="valkey",
                                 layout_fingerprint=layout_fingerprint, codec=codec))

    @property
    def _redis(self):
        """The redis-py client now (a single-server client becomes a cluster client once
        the server says it is a cluster node)."""
        return self._conn.client

    # -- the StorageTier interface -------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        check_tier_keys(keys)
        return self._view.contains(keys)

    def submit_write(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        check_tier_request(keys, buffers)
        return self._submit(keys, buffers, self._write_batch)

    def submit_read(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        check_tier_request(keys, buffers)
        return self._submit(keys, buffers, self._reads.read_batch, max_batch=READ_BATCH_BYTES)

    def poll(self) -> list[TierJobResult]:
        return self._book.poll()

    def close(self) -> None:
        """Bounded: running requests end by their deadline, and the Outage that their
        failure opens makes queued ones fail at once."""
        if not self._book.close():
            return
        self._refresher.stop(timeout_s=self.config.request_timeout_s + self.config.timeout_s)
        self._feed.close()
        self._io.shutdown(wait=True)
        self._conn.close()

    # -- optional hooks --------------------------------------------------------------------

    def take_changes(self, max_keys: int) -> TierChanges:
        return self._view.take_changes(max_keys)

    def find(self, keys: Sequence[bytes]) -> list[bool]:
        """One pipelined ``EXISTS`` per key, a round trip per server, within
        ``request_timeout_s``; found keys join the view (finds.py). A server in an outage
        is not asked: its keys are answered from the view."""
        check_tier_keys(keys)
        return self._finds.find(keys)

    def keys(self) -> list[bytes]:
        return self._view.keys()

    def clear(self) -> None:
        """Delete every key of this layout on the server (for every process sharing it), and
        forget them. A server that cannot be reached keeps them: logged, counted."""
        self._view.clear()
        try:
            for node in self._conn.primaries():
                cursor = None
                while cursor != 0:
                    cursor, names = self._conn.scan_page(node, cursor or 0, self._match(),
                                                         self.config.scan_count)
                    if names:  # (the cluster client splits a multi-key UNLINK by slot)
                        self._redis.unlink(*names)
        except SERVER_ERRORS as e:
            self._book.count("clear_failed")
            self._book.note("clear", "could not delete the keys of %s on %s: %s",
                            self._namespace, self.config.display_url, e)

    def describe(self) -> str:
        return f"valkey {self.config.display_url} (eviction: the server's maxmemory policy)"

    def stats(self) -> TierStats:
        """Keys in the view; the server's used memory and maxmemory (whole server, as of the
        last refresh: the server, not this tier, decides what it evicts)."""
        used, budget = self._server_memory
        counts = self._book.counts()
        counts["outages"], counts["failed_fast"] = self._outages.episodes, self._outages.skipped
        counts["servers_down"] = self._outages.down
        return TierStats(keys=len(self._view), bytes_used=used, bytes_budget=budget,
                         counts=counts)

    def read_generation(self) -> bytes | None:
        """The generation record, a value beside the keys of this layout (None if absent;
        an unreachable server raises, bounded by the timeouts)."""
        value = self._redis.get(self._generation_name())
        return value if isinstance(value, bytes) else None

    def write_generation(self, record: bytes) -> bool:
        try:
            self._redis.set(self._generation_name(), record)  # (plain SET: replaces it)
        except SERVER_ERRORS as e:
            logger.warning("kv-offload: could not write the generation record to %s: %s",
                           self.config.display_url, e)
            return False
        return True

    def create_generation(self, record: bytes) -> bytes | None:
        """SET NX (the first starter's record stays), then the record the server holds.
        An unreachable server raises (bounded by the timeouts)."""
        if self._redis.set(self._generation_name(), record, nx=True):
            return record
        return self.read_generation()

    def refresh(self) -> None:
        """SCAN every server whole now (each primary of a cluster): adopt keys others wrote,
        drop keys they no longer hold. Runs at start; the refresher thread polls instead."""
        if not self._settled():
            return
        if not self._crawl.full():  # a primary not scanned: its keys are not known gone
            self._book.count("refresh_failed")
            return
        self._update_memory()
        self._book.count("refreshes")

    def _poll(self) -> None:
        """One background poll: the keyspace notifications that arrived (bounded), then the
        next pages of the paced SCAN (bounded). Work proportional to what changed."""
        if not self._settled():
            return
        self._feed.poll()
        self._crawl.poll()
        if time.monotonic() - self._memory_at >= MEMORY_INTERVAL_S:
            self._update_memory()

    def _settled(self) -> bool:
        """Whether the connection knows what the server is (single or cluster node); an
        unreachable server at start is asked again here, once it answers."""
        if self._conn.decided:
            return True
        if not self._outages.of(SINGLE).should_try():
            return False
        try:
            with request_deadline(self.config.request_timeout_s):
                self._conn.settle()
        except SERVER_ERRORS as e:
            self._outages.of(SINGLE).failed(e)
            self._book.count("refresh_failed")
            return False
        self._feed.start()
        return True

    def _update_memory(self) -> None:
        self._memory_at = time.monotonic()
        try:
            with request_deadline(self.config.request_timeout_s):
                self._server_memory = self._conn.memory()
        except SERVER_ERRORS:
            pass  # (the memory figures are for stats only: keep the last ones)

    # -- internals -------------------------------------------------------------------------

    def _name(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def _generation_name(self) -> bytes:
        return self._prefix + b"generation"  # (not hex: never taken for a key by a SCAN)

    def _key_of(self, name: bytes) -> bytes | None:
        try:
            return bytes.fromhex(name[len(self._prefix):].decode("ascii")) or None
        except ValueError:
            return None  # not one of ours (a user's key under the same prefix)

    def _match(self) -> bytes:
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in self._namespace)
        return (escaped + "*").encode()

    def _submit(self, keys, buffers, run_batch, max_batch: int | None = None) -> int:
        job = self._book.new_job(keys)
        # One group per server (a cluster's primary, by key slot): a batch is one pipeline
        # to one node, and a dead node fails only its own batches.
        by_node: dict[str, list] = {}
        for item in enumerate(zip(keys, buffers)):
            by_node.setdefault(self._conn.node_of(self._name(item[1][0])), []).append(item)
        # Spread the job over the connections, each batch at most batch_bytes of values
        # (and max_batch); a key larger than that is a batch of its own.
        total = sum(buf.numel() for buf in buffers)
        cap = min(self.config.batch_bytes, -(-total // self.config.connections),
                  max_batch or total)
        for node, items in by_node.items():
            batch, size = [], 0
            for item in items:
                batch.append(item)
                size += item[1][1].numel()
                if size >= cap:
                    self._book.start(self._io, self._within_deadline, run_batch, job, node,
                                     batch)
                    batch, size = [], 0
            if batch:
                self._book.start(self._io, self._within_deadline, run_batch, job, node, batch)
        return job.job_id

    def _within_deadline(self, run_batch, job: Job, node: str, batch: list) -> None:
        """One batch's round trips, together bounded by ``request_timeout_s``."""
        with request_deadline(self.config.request_timeout_s):
            run_batch(job, self._outages.of(node), batch)

    def _write_batch(self, job: Job, outage, batch: list) -> None:
        done: list[int] = []
        try:
            if not outage.should_try():
                self._book.count("write_failed", "write_failed_unreachable", n=len(batch))
                return
            names = [self._name(key) for _, (key, _) in batch]
            present = self._conn.pipelined(lambda pipe: [pipe.exists(n) for n in names])
            refused = next((r for r in present if isinstance(r, Exception)), None)
            if refused is not None:
                raise refused
            todo = [(item, name) for item, name, held in zip(batch, names, present) if not held]
            done += [i for (i, _), held in zip(batch, present) if held]
            self._book.count("write_skipped_present", n=len(done))
            values = [self._encode(key, buf) for (_, (key, buf)), _ in todo]
            results = self._conn.pipelined(lambda pipe: [
                pipe.set(name, value, nx=True) for (_, name), value in zip(todo, values)])
            for ((i, (_, buf)), _), value, result in zip(todo, values, results):
                if isinstance(result, Exception):  # e.g. OOM under maxmemory noeviction
                    self._book.count("write_failed", "write_failed_refused")
                    self._book.note("write-refused", "%s refused a write: %s",
                                    self.config.display_url, result)
                else:  # True: set; None: another writer set it first (same bytes)
                    done.append(i)
                    self._book.count("write_ok")
                    self._book.count("bytes_written", n=buf.numel())
                    self._book.count("page_bytes_written", n=buf.numel())
                    self._book.count("record_bytes_written", n=(
                        value.nbytes if isinstance(value, SplitValue) else len(value)))
            outage.succeeded()
        except SERVER_ERRORS as e:
            outage.failed(e)
            self._book.count("write_failed", "write_failed_unreachable", n=len(batch) - len(done))
        except Exception:
            self._book.count("write_failed", "write_failed_bug", n=len(batch) - len(done))
            logger.exception("kv-offload: unexpected error writing to %s", self.config.display_url)
        finally:
            ok = set(done)
            self._view.add(key for i, (key, _) in batch if i in ok)
            self._book.finish(job, done, True)
            self._book.finish(job, [i for i, _ in batch if i not in ok], False)

    def _encode(self, key: bytes, buf: torch.Tensor) -> SplitValue | bytes:
        """The value of ``key``: its record, sent from the host buffer without a copy."""
        data, fingerprint, codec = host_view(buf), self.config.layout_fingerprint, \
            self.config.codec
        if self._packer is None or codec.encrypts or codec.compression is not None:
            # (ciphertext, a compressed payload: one buffer either way)
            return pack(key, fingerprint, data, align=NETWORK_ALIGN, codec=codec)
        header = build_header(key, fingerprint, len(data), codec.seal(key, fingerprint, data),
                              align=NETWORK_ALIGN, codec=codec)
        return SplitValue(header, data)
