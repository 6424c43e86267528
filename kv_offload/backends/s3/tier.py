"""S3Tier: KV blocks as objects in an S3-compatible store (AWS S3, MinIO, Ceph RGW...).

- One object per block, ``<prefix><layout namespace>/<key hex>``, holding a record
  (``kv_offload.backends.record``: format version, layout fingerprint, key, xxh3 checksum,
  data): an object from another layout or damaged is a miss and is deleted; never wrong bytes.
  With ``secret_file`` the checksum is a keyed tag or AES-GCM (``config.codec``): an object
  written without the secret is refused and deleted the same way, counted as
  ``rejected_records``, logged once per episode; deleting it is what keeps a planted object
  from blocking ``If-None-Match`` writes of the real one for good.
  One object per block, not per chunk of blocks: a block is the unit the engine asks for,
  and blocks of one prompt are hit and evicted independently. (``kv-offload bench --backend
  s3`` measures the per-object cost at 1, 4 and 16 MiB; objects grouping several blocks were
  not built or measured.)
- Writes use ``If-None-Match: *`` where the store supports it: the same key always names the
  same bytes, so an object already there is never sent twice (a store that refuses the
  header gets plain puts from then on).
- An object store does not evict: ``bytes_to_use`` bounds the objects this engine wrote, and
  only those are evicted by it (``BucketKeys`` in keys.py: the disk tier's ``KeyIndex``, a
  segmented LRU where objects a hit used outlive those stored once, a key being read is never
  evicted, victims deleted only once the write that
  needed their room landed). Other writers' objects, adopted from listings of the prefix
  (listing.py: at start, then a crawl of a few pages per ``refresh_interval_s``), are served
  but never deleted by this engine (bad ones aside):
  one engine with a small budget cannot empty the fleet's prefix. Objects nobody owns any
  more are the bucket lifecycle rule's to expire; ``evict_others`` makes a single owner keep
  the whole prefix within its budget instead.
- Reads are ranged GETs of at most the record the caller's buffer needs (common/sized_read.py): an
  object of another size costs no more memory than the buffer.
- ``find`` asks the bucket about named keys now (a ``HEAD`` each, finds.py), for a caller that
  cannot wait for the crawl to pass their names.
- ``lookup`` answers from that index (never the network). Jobs run one request per key on
  ``connections`` threads, each request sent to a helper process that runs botocore
  (remote_client.py; ``helper_process: false``: in this process); every request is bounded
  by ``request_timeout_s`` as a whole however slowly the endpoint sends (common/deadline.py), an
  unreachable endpoint makes later jobs fail fast for ``retry_interval_s`` (``Outage``),
  one log line per episode. A reply whose body stalls after its header is such a timeout
  too: bodies are read through ``client.read_body``, which raises botocore's errors.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from botocore.exceptions import BotoCoreError, ClientError

from kv_offload.backends.base import (
    StorageTier,
    TierChanges,
    TierJobResult,
    TierStats,
    check_tier_keys,
    check_tier_request,
)
from kv_offload.backends.common.deadline import install_deadlines, request_deadline
from kv_offload.backends.common.host_buffers import host_view
from kv_offload.backends.common.index import Reservation
from kv_offload.backends.common.io_threads import IoThreads
from kv_offload.backends.common.jobs import Job, JobBook
from kv_offload.backends.common.options import parse_options
from kv_offload.backends.common.outage import Outage
from kv_offload.backends.common.refresher import Refresher
from kv_offload.backends.common.rejections import Rejections
from kv_offload.backends.common.sized_read import expected_bytes, judge_wrong_size
from kv_offload.backends.record import (
    CHECKSUM,
    NETWORK_ALIGN,
    RecordCodec,
    data_offset,
    pack,
    unpack_into,
)
from kv_offload.backends.s3.client import make_client, read_body
from kv_offload.backends.s3.config import S3TierConfig
from kv_offload.backends.s3.finds import S3Finds
from kv_offload.backends.s3.keys import BucketKeys
from kv_offload.backends.s3.listing import PrefixListing
from kv_offload.backends.s3.remote_client import HelperClient
from kv_offload.config import format_size
from kv_offload.runtime.affinity import join_our_cpus

logger = logging.getLogger(__name__)

# Replies that mean the endpoint is in trouble, not that one request was wrong.
SERVER_TROUBLE = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout",
                  "503", "500"}
ABSENT = {"NoSuchKey", "404"}
MAX_DELETE = 1000  # objects per DeleteObjects request (the S3 limit)


class S3Tier(StorageTier):
    """A ``StorageTier`` on an S3-compatible bucket (see the module docstring)."""

    shared = True  # every client of the bucket can write: secret_file or trusted_store

    def __init__(self, config: S3TierConfig) -> None:
        self.config = config
        self._root = f"{config.prefix}{config.codec.namespace(config.layout_fingerprint)}/"
        # (the helper process installs the deadlines on its own client)
        self._s3 = HelperClient(config) if config.helper_process else make_client(config)
        self._index = BucketKeys(config.bytes_to_use, config.evict_others)
        self._book = JobBook("S3Tier", logger)
        if not config.helper_process and not install_deadlines(self._s3):  # pragma: no cover
            logger.warning("kv-offload: cannot bound whole requests to %s with this botocore; "
                           "only each socket read is bounded (timeout_s)", config.endpoint_url)
        where = config.endpoint_url or "AWS S3"
        self._where = f"s3://{config.bucket}/{self._root} at {where}"
        self._outage = Outage(f"object store {where}", config.retry_interval_s, logger)
        self._rejections = Rejections(f"kv-offload S3 tier {self._where}")
        self._conditional = config.conditional_put
        # (not a ThreadPoolExecutor: 18 tracked objects per queued write there, 6 here;
        # common/io_threads.py)
        self._io = IoThreads(config.connections, "kv-s3-io", initializer=join_our_cpus)
        self._refresher = Refresher(self.poll_listing, config.refresh_interval_s,
                                    name="kv-s3-refresh", what=self._where)
        self._listing = PrefixListing(
            self._s3, config.bucket, self._root, self._index,
            pages_per_poll=config.list_pages_per_refresh,
            request_objects=config.list_request_objects,
            request_timeout_s=config.request_timeout_s, outage=self._outage, book=self._book,
            stopping=self._refresher.stopping, trouble=self._trouble, delete=self._delete)
        self._finds = S3Finds(self._s3, config.bucket, self._index, self._io,
                              request_timeout_s=config.request_timeout_s,
                              outage=self._outage, book=self._book, name_of=self._name,
                              trouble=self._trouble)
        self.refresh()  # the objects already there, before the first lookup
        self._refresher.start()

    @classmethod
    def check_options(cls, options) -> None:
        parse_options(S3TierConfig, options, tier="s3", layout_fingerprint="check")

    @classmethod
    def from_options(cls, options, layout_fingerprint: str, *,
                     codec: RecordCodec = CHECKSUM) -> S3Tier:
        return cls(parse_options(S3TierConfig, options, tier="s3",
                                 layout_fingerprint=layout_fingerprint, codec=codec))

    # -- the StorageTier interface -------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        check_tier_keys(keys)
        return self._index.contains(list(keys))

    def touch(self, keys: Sequence[bytes]) -> None:
        """Keys of a hit: kept before objects stored once and never asked for (memory only)."""
        self._index.touch(keys)

    def submit_write(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        check_tier_request(keys, buffers)
        job = self._book.new_job(keys)
        fingerprint = self.config.layout_fingerprint
        for i, (key, buf) in enumerate(zip(keys, buffers)):
            if self._index.present(key):  # same key, same bytes: already stored
                self._book.count("write_skipped_present")
                self._book.finish(job, [i], True)
                continue
            size = data_offset(key, fingerprint, buf.numel(), align=NETWORK_ALIGN,
                               codec=self.config.codec) + buf.numel()
            reservation = self._index.reserve(size)  # victims go once this write landed
            if reservation is None:
                self._book.count("write_failed", "write_failed_budget")
                self._book.finish(job, [i], False)
                continue
            self._book.start(self._io, self._within_deadline, self._write_one, job, i, key, buf,
                             size, reservation)
        return job.job_id

    def submit_read(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        check_tier_request(keys, buffers)
        job = self._book.new_job(keys)
        for i, (key, buf) in enumerate(zip(keys, buffers)):
            if not self._index.begin_read(key):
                self._book.count("read_failed", "read_failed_absent")
                self._book.finish(job, [i], False)
                continue
            self._book.start(self._io, self._within_deadline, self._read_one, job, i, key, buf)
        return job.job_id

    def poll(self) -> list[TierJobResult]:
        return self._book.poll()

    def close(self) -> None:
        if not self._book.close():
            return
        # Bounded: requests end by their deadline; the Outage their failure opens makes
        # queued ones fail at once.
        self._refresher.stop(timeout_s=self.config.request_timeout_s + self.config.timeout_s)
        self._io.shutdown(wait=True)
        self._s3.close()  # (the helper process ends with it)

    # -- optional hooks --------------------------------------------------------------------

    def take_changes(self, max_keys: int) -> TierChanges:
        return self._index.feed.take(max_keys)  # (own and others' changes: one feed)

    def find(self, keys: Sequence[bytes]) -> list[bool]:
        """A ``HEAD`` per key on the I/O threads, all within ``request_timeout_s``; objects
        found are adopted as the listing adopts them (finds.py). An endpoint in an outage
        is not asked: the view answers."""
        check_tier_keys(keys)
        return self._finds.find(keys)

    def keys(self) -> list[bytes]:
        return self._index.keys()

    def clear(self) -> None:
        """Delete every object of this layout under the prefix (every writer's), and forget
        them. An unreachable endpoint keeps them: logged, counted."""
        held = self._index.keys()  # (a snapshot: removing while iterating the index)
        for key in held:
            self._index.remove(key)
        try:
            after = {}  # (requests, not a paginator: the helper's client has none)
            while names := [obj["Key"] for obj in self._s3.list_objects_v2(
                    Bucket=self.config.bucket, Prefix=self._root, **after).get("Contents", [])]:
                self._delete_names(names)
                after = {"StartAfter": names[-1]}
        except (BotoCoreError, ClientError, OSError) as e:
            self._book.count("clear_failed")
            self._book.note("clear", "could not delete the objects of %s: %s", self._where, e)

    def describe(self) -> str:
        where = self.config.endpoint_url or "AWS S3"
        return f"s3 {where} bucket {self.config.bucket!r} (budget " \
            f"{format_size(self.config.bytes_to_use)}, segmented LRU)"

    def stats(self) -> TierStats:
        counts = self._book.counts()
        counts["outages"], counts["failed_fast"] = self._outage.episodes, self._outage.skipped
        counts["servers_down"] = int(self._outage.down)
        return TierStats(keys=len(self._index), bytes_used=self._index.used_bytes,
                         bytes_budget=self.config.bytes_to_use, counts=counts)

    def read_generation(self) -> bytes | None:
        """The generation record, an object beside this layout's (None if absent; an
        unreachable endpoint raises, bounded by the timeouts)."""
        try:
            reply = self._s3.get_object(Bucket=self.config.bucket, Key=self._generation_name(),
                                        Range=f"bytes=0-{(1 << 16) - 1}")
        except ClientError as e:
            if _code(e) in ABSENT:
                return None
            if _code(e) in ("InvalidRange", "416"):  # an empty object
                return b""
            raise
        return read_body(reply, 1 << 16)

    def write_generation(self, record: bytes) -> bool:
        try:  # (a plain put: replaces it)
            self._s3.put_object(Bucket=self.config.bucket, Key=self._generation_name(),
                                Body=record)
        except (BotoCoreError, ClientError, OSError) as e:
            logger.warning("kv-offload: could not write the generation record of %s: %s",
                           self._where, e)
            return False
        return True

    def create_generation(self, record: bytes) -> bytes | None:
        """A conditional put (If-None-Match: the first starter's object stays), then the
        record the bucket holds. An endpoint that does not support conditional puts answers
        501: a plain put then (two engines starting at once may each keep their own until a
        restart: a cold cache, never pre-reset keys). An unreachable endpoint raises."""
        try:
            self._s3.put_object(Bucket=self.config.bucket, Key=self._generation_name(),
                                Body=record, IfNoneMatch="*")
            return record
        except ClientError as e:
            if _code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict",
                            "409"):
                return self.read_generation()
            if _code(e) not in ("NotImplemented", "501"):
                raise
        # (an endpoint without conditional puts; an unreachable one raised above)
        return record if self.write_generation(record) else None

    def refresh(self) -> None:
        """List the whole prefix now: adopt others' objects, drop vanished ones, evict to
        budget (the background thread lists a few pages per poll instead: listing.py)."""
        self._listing.full()

    def poll_listing(self) -> None:
        """One bounded step of the background listing (its thread's, every
        ``refresh_interval_s``): at most ``list_pages_per_refresh`` pages."""
        self._listing.poll()

    # -- internals -------------------------------------------------------------------------

    def _within_deadline(self, request, *args) -> None:
        """One request (a PUT, a GET), bounded as a whole by ``request_timeout_s``."""
        with request_deadline(self.config.request_timeout_s):
            request(*args)

    def _name(self, key: bytes) -> str:
        return self._root + key.hex()

    def _generation_name(self) -> str:
        return self._root + "generation"  # (not hex: a listing never takes it for a key)

    def _write_one(self, job: Job, i: int, key: bytes, buf: torch.Tensor, size: int,
                   reservation: Reservation) -> None:
        ok = False
        try:
            if not self._outage.should_try():
                self._book.count("write_failed", "write_failed_unreachable")
                return
            record = pack(key, self.config.layout_fingerprint, host_view(buf),
                          align=NETWORK_ALIGN, codec=self.config.codec)
            size = len(record)  # (smaller than reserved when compressed)
            sent = self._put(key, record)
            victims = self._index.commit(reservation, key, size, sent)
            ok = True
            self._outage.succeeded()
            self._delete(victims)  # only now: a failed write costs nothing but itself
            if sent:
                self._book.count("write_ok")
                self._book.count("bytes_written", n=size)
                self._book.count("page_bytes_written", n=buf.numel())
                self._book.count("record_bytes_written", n=size)
            else:
                self._book.count("write_skipped_present")
        except (BotoCoreError, ClientError, OSError) as e:
            self._trouble("write", e)
        except Exception:
            self._book.count("write_failed", "write_failed_bug")
            logger.exception("kv-offload: unexpected error writing to %s", self._where)
        finally:
            if not ok:
                self._index.release(reservation)  # its victims stay
            self._book.finish(job, [i], ok)

    def _put(self, key: bytes, body: bytes) -> bool:
        """Store one object: True; False if it was already there (412 to If-None-Match)."""
        args = {"Bucket": self.config.bucket, "Key": self._name(key), "Body": body}
        if self._conditional:
            try:
                self._s3.put_object(**args, IfNoneMatch="*")
                return True
            except ClientError as e:
                code = _code(e)
                if code in ("PreconditionFailed", "412"):
                    return False
                if code not in ("NotImplemented", "501"):
                    raise
                self._conditional = False  # this store does not do conditional puts
                self._book.note("no-conditional", "%s refuses If-None-Match: * (%s); writing "
                                "with plain puts", self._where, code)
        self._s3.put_object(**args)
        return True

    def _read_one(self, job: Job, i: int, key: bytes, buf: torch.Tensor) -> None:
        ok = False
        try:
            if not self._outage.should_try():
                self._book.count("read_failed", "read_failed_unreachable")
                return
            fingerprint = self.config.layout_fingerprint
            want = expected_bytes(key, fingerprint, buf.numel(), self.config.codec)
            reply = self._s3.get_object(Bucket=self.config.bucket, Key=self._name(key),
                                        Range=f"bytes=0-{want - 1}")
            held = _object_size(reply)
            # (a body that stalls past the deadline: botocore's ReadTimeoutError, below)
            body = read_body(reply, min(want, reply.get("ContentLength", want)))
            self._outage.succeeded()
            codec = self.config.codec
            if held < want and len(body) == held:  # smaller, read whole: compressed, or
                # a plain record of another size (judged there)
                got = unpack_into(body, key, fingerprint, host_view(buf), align=NETWORK_ALIGN,
                                  codec=codec)
            elif held != want:  # only its start was read
                got = judge_wrong_size(body, held, key, fingerprint, buf.numel(), codec)
            else:
                got = unpack_into(body, key, fingerprint, host_view(buf), align=NETWORK_ALIGN,
                                  codec=codec)
            if got.bad is not None:
                self._discard(key, got.bad)
            elif not got.ok:
                self._book.count("read_failed", "read_failed_buffer_size")
                self._book.note("buffer-size", "key %s holds %d bytes but the read buffer has "
                                "%d; not served", key.hex(), got.held_bytes, buf.numel())
            else:
                ok = True
                self._rejections.verified()
                self._book.count("read_ok")
                self._book.count("bytes_read", n=len(body))
        except ClientError as e:
            if _code(e) in ABSENT:  # deleted by another writer (or its budget)
                self._forget([key])
                self._book.count("read_failed", "read_failed_vanished")
            elif _code(e) in ("InvalidRange", "416"):  # an empty object: not a record
                self._discard(key, "empty object")
            else:
                self._trouble("read", e)
        except (BotoCoreError, OSError) as e:
            self._trouble("read", e)
        except Exception:
            self._book.count("read_failed", "read_failed_bug")
            logger.exception("kv-offload: unexpected error reading from %s", self._where)
        finally:
            self._index.end_read(key)
            self._book.finish(job, [i], ok)

    def _discard(self, key: bytes, reason: str) -> None:
        """An object that is not ours to serve: delete it, forget the key."""
        self._forget([key])
        self._book.count("read_failed", "bad_objects_removed", "rejected_records")
        self._rejections.rejected(key, f"{self._name(key)}: {reason}")
        self._delete([key])

    def _forget(self, keys: list[bytes]) -> None:
        for key in keys:
            self._index.remove(key)

    def _delete(self, keys: list[bytes]) -> None:
        """Delete objects (already out of the index); failures only leave garbage behind
        (over budget until the next listing evicts it again)."""
        try:
            self._delete_names([self._name(k) for k in keys])
            self._book.count("evictions", n=len(keys))
        except (BotoCoreError, ClientError, OSError) as e:
            self._trouble("delete", e)

    def _delete_names(self, names: list[str]) -> None:
        for start in range(0, len(names), MAX_DELETE):
            chunk = names[start:start + MAX_DELETE]
            self._s3.delete_objects(Bucket=self.config.bucket, Delete={
                "Objects": [{"Key": name} for name in chunk], "Quiet": True})

    def _trouble(self, what: str, error: Exception) -> None:
        """Count a failed request; the endpoint's own trouble opens an outage episode."""
        code = _code(error) if isinstance(error, ClientError) else None
        if code is None or code in SERVER_TROUBLE:
            self._outage.failed(error)
            self._book.count(f"{what}_failed", f"{what}_failed_unreachable")
        else:
            self._book.count(f"{what}_failed", f"{what}_failed_{code}")
            self._book.note(f"{what}-{code}", "%s of %s refused: %s", what, self._where, error)


def _object_size(reply: dict) -> int:
    """The whole object's size from a ranged GET's reply (``Content-Range: bytes 0-N/SIZE``;
    a store that ignored the range sends it all: its ``ContentLength``)."""
    whole = str(reply.get("ContentRange", "")).rpartition("/")[2]
    return int(whole) if whole.isdigit() else int(reply.get("ContentLength", 0))


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))
