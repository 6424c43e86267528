"""The Valkey tier's read path: bounded reads, each reply checked before a byte is served.

A batch is one pipelined round trip to one server: ``STRLEN`` + ``GETRANGE 0 expected-1`` per
key, so a value of another size costs at most the bytes the caller's buffer expects (see
common/sized_read.py). Each reply is then judged: absent (evicted, deleted: a miss, the key leaves
the view), refused by the server (counted, noted once), a value that is not ours to serve
(damaged, foreign, written without the secret: deleted so that the next write replaces it,
counted as ``rejected_records``), an intact value of another size (the caller's buffer is
wrong: kept), or verified and served. A value of the expected size is received straight into
the host buffer and verified (decrypted) there, in place (direct_reads.py); redis-py's
pipeline runs the batch instead where its cluster client must route it again.

A server that fails mid-batch (down, stalled past the deadline, a cluster node between
primaries) makes the rest of the batch misses and opens that server's ``Outage``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

from kv_offload.backends.common.host_buffers import host_view
from kv_offload.backends.common.jobs import Job, JobBook
from kv_offload.backends.common.outage import Outage
from kv_offload.backends.common.rejections import Rejections
from kv_offload.backends.common.server_keys import ServerKeys
from kv_offload.backends.common.sized_read import expected_bytes, judge_wrong_size
from kv_offload.backends.record import (
    NETWORK_ALIGN,
    RecordFormatError,
    check_header,
    data_offset,
    unpack_in_place,
    unpack_into,
)
from kv_offload.backends.valkey.config import ValkeyTierConfig
from kv_offload.backends.valkey.connection import (
    DROPPED_UNDER_US,
    SERVER_ERRORS,
    ValkeyConnection,
)
from kv_offload.backends.valkey.direct_reads import (
    InPlace,
    ReadItem,
    Unparsed,
    read_sized,
    redirected,
)

logger = logging.getLogger("kv_offload.backends.valkey.tier")  # (the tier's log lines)


class ValkeyReads:
    """Runs read batches for one ``ValkeyTier`` (its config, client, job book and view)."""

    def __init__(self, config: ValkeyTierConfig, conn: ValkeyConnection, book: JobBook,
                 view: ServerKeys, rejections: Rejections,
                 name_of: Callable[[bytes], bytes]) -> None:
        self._config = config
        self._conn = conn
        self._book = book
        self._view = view
        self._rejections = rejections
        self._name_of = name_of

    def read_batch(self, job: Job, outage: Outage, batch: list) -> None:
        done: list[int] = []
        try:
            if not outage.should_try():
                self._book.count("read_failed", "read_failed_unreachable", n=len(batch))
                return
            fingerprint, codec = self._config.layout_fingerprint, self._config.codec
            items = []
            for _, (key, buf) in batch:  # the size, and at most the bytes we expect
                offset = data_offset(key, fingerprint, buf.numel(), align=NETWORK_ALIGN,
                                     codec=codec)
                items.append(ReadItem(self._name_of(key), offset + buf.numel(), offset,
                                      host_view(buf), self._header_check(key, buf.numel())))
            replies = self._direct(items)
            if replies is None:
                replies = self._pipelined(items)
            outage.succeeded()
            for (i, (key, buf)), (held, value) in zip(batch, replies):
                if self._fill(key, held, value, buf):
                    done.append(i)
        except SERVER_ERRORS as e:
            outage.failed(e)
            self._book.count("read_failed", "read_failed_unreachable", n=len(batch) - len(done))
        except Exception:
            self._book.count("read_failed", "read_failed_bug", n=len(batch) - len(done))
            logger.exception("kv-offload: unexpected error reading from %s",
                             self._config.display_url)
        finally:
            ok = set(done)
            self._view.add(key for i, (key, _) in batch if i in ok)
            self._book.finish(job, done, True)
            self._book.finish(job, [i for i, _ in batch if i not in ok], False)

    def _header_check(self, key: bytes, data_len: int) -> Callable[[bytes], bool]:
        """Whether a received header is this key's, for this layout and size (checked before
        its data may enter the host buffer)."""
        fingerprint, codec = self._config.layout_fingerprint, self._config.codec

        def ok(head: bytes) -> bool:
            try:
                check_header(head, key, fingerprint, data_len, align=NETWORK_ALIGN, codec=codec)
            except RecordFormatError:
                return False
            return True
        return ok

    def _direct(self, items: list[ReadItem]) -> list[tuple] | None:
        """The batch's replies, values read straight into the host buffers (direct_reads.py),
        or None where redis-py's pipeline must run it: a cluster redirection, or a cluster
        node that failed (its client then re-reads the slot table, as before)."""
        pool = self._conn.pool_of([item.name for item in items])
        if pool is None:  # (the keys moved apart since the batch was made)
            return None
        try:
            connection = pool.get_connection()
        except (*SERVER_ERRORS, *DROPPED_UNDER_US):
            if self._conn.cluster:  # (the pipeline path reconnects or opens the outage)
                return None
            raise
        try:
            replies = read_sized(connection, items)
        except Unparsed:  # (a reply for redis-py, e.g. a push message: let it read them)
            connection.disconnect()
            return None
        except BaseException as e:  # (mid-reply: what is left on the socket is not ours)
            connection.disconnect()
            if self._conn.cluster and isinstance(e, (*SERVER_ERRORS, *DROPPED_UNDER_US)):
                return None
            raise
        finally:
            pool.release(connection)
        return None if redirected(replies) else replies

    def _pipelined(self, items: list[ReadItem]) -> list[tuple]:
        """The same commands through redis-py's (cluster) pipeline, which follows MOVED and
        ASK and handles a failed node; values arrive as ``bytes``."""
        def queue(pipe) -> None:
            for item in items:
                pipe.strlen(item.name)
                pipe.getrange(item.name, 0, item.expected - 1)
        replies = self._conn.pipelined(queue)
        return list(zip(replies[::2], replies[1::2]))

    def _fill(self, key: bytes, held, value, buf: torch.Tensor) -> bool:
        """Check one STRLEN + GETRANGE reply and copy its data into ``buf``; False (and why,
        counted) if it cannot be served."""
        refused = next((r for r in (held, value) if isinstance(r, Exception)), None)
        if refused is not None:  # e.g. WRONGTYPE: not a string
            self._book.count("read_failed", "read_failed_refused")
            self._book.note("read-refused", "%s refused a read: %s", self._config.display_url,
                            refused)
            return False
        if not held:  # evicted by the server, or deleted by another process
            self._view.discard([key])
            self._book.count("read_failed", "read_failed_absent")
            return False
        fingerprint, codec = self._config.layout_fingerprint, self._config.codec
        if held < expected_bytes(key, fingerprint, buf.numel(), codec) and \
                isinstance(value, bytes) and len(value) == held:  # smaller, received whole:
            # a compressed record (or a plain one of another size: judged there)
            got = unpack_into(value, key, fingerprint, host_view(buf), align=NETWORK_ALIGN,
                              codec=codec)
        elif held != expected_bytes(key, fingerprint, buf.numel(), codec):  # only its start
            got = judge_wrong_size(value, held, key, fingerprint, buf.numel(), codec)
        elif isinstance(value, InPlace):  # (the data is in buf already: checked there)
            got = unpack_in_place(value.head, key, fingerprint, host_view(buf),
                                  align=NETWORK_ALIGN, codec=codec)
        else:
            got = unpack_into(value, key, fingerprint, host_view(buf), align=NETWORK_ALIGN,
                              codec=codec)
        if got.bad is not None:
            return self._discard(key, got.bad)
        if not got.ok:  # an intact value of another size: the caller's buffer is wrong
            self._book.count("read_failed", "read_failed_buffer_size")
            self._book.note("buffer-size", "key %s holds %d bytes but the read buffer has %d; "
                            "not served", key.hex(), got.held_bytes, buf.numel())
            return False
        self._rejections.verified()
        self._book.count("read_ok")
        self._book.count("bytes_read", n=buf.numel())
        return True

    def _discard(self, key: bytes, reason: str) -> bool:
        """A value that is not ours to serve: delete it (a later write replaces it), forget
        the key, report a miss."""
        self._view.discard([key])
        self._book.count("read_failed", "bad_values_removed", "rejected_records")
        self._rejections.rejected(key, f"on {self._config.display_url}: {reason}")
        with contextlib.suppress(*SERVER_ERRORS):  # if not, the next read finds it bad again
            self._conn.client.unlink(self._name_of(key))
        return False
