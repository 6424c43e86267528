"""Read batches whose values land straight in the host buffers: no whole-value copies.

Through redis-py's pipeline every byte of a loaded value is copied three times in the client
after the kernel's copy into user space: hiredis appends each received chunk to its reply
buffer (growing it by reallocation), then builds the value's ``bytes`` from that buffer, and
``unpack_into`` copies the data into the host buffer. py-spy over the I/O threads of a
cluster load (4 MiB values, loopback) put about half of their samples in hiredis' reading and
copying, and more threads made it worse: every 64 KiB received means a GIL hand-over to a
thread that copies. So a read batch here sends the same ``STRLEN`` + ``GETRANGE 0
expected-1`` pipeline on a connection of redis-py's own pool (with its packer, its
deadline-bounded socket, its credentials and TLS) and reads the replies itself: the small
ones (integers, errors, a value of another size: at most the bytes the buffer expects) into
a scratch buffer; a value of exactly the expected size as its header into ``bytes`` and,
if that header is this key's for this layout and size, its data with ``recv_into`` straight
into the host buffer, where the caller verifies (and decrypts) it in place, as the filesystem
tier does. Nothing is served before it verifies; but a value whose data fails its digest has
then been received into the buffer (as with the filesystem tier, or a failed decryption):
the key fails, and a failed read's buffer is never served. A foreign or damaged header keeps
its data out of the buffer.

Only what these two commands answer is parsed, in RESP2 or RESP3 (redis-py 8 speaks RESP3
by default): integers, bulk strings, errors, null. redis-py keeps everything else: the caller
closes the connection and runs the batch through its pipeline when a reply is anything else
(a RESP3 push message, e.g. a maintenance notification, is for redis-py's handlers: it is
``Unparsed``), a cluster redirection (MOVED, ASK, TRYAGAIN, CLUSTERDOWN), or a cluster node's
socket fails, so that the cluster client follows the redirection or re-reads the slot table
as before; a failed socket on a single server raises (an outage, as before). A connection
that failed mid-reply is closed, never reused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import redis
from redis.exceptions import AskError, ClusterDownError, ResponseError, TryAgainError

try:  # (redis-py's own error-reply parser: the same exception classes as its pipeline)
    from redis._parsers.base import BaseParser

    _parse_error = BaseParser.parse_error
except ImportError:  # pragma: no cover - a redis-py that moved it
    _parse_error = ResponseError

CRLF = b"\r\n"
SCRATCH_BYTES = 64 << 10  # headers and small replies; a bulk value bypasses it
# The longest error text read (a RESP3 blob error): a length read from the wire is bounded by
# what that reply may be before anything is allocated for it (a server announcing 1 GiB for
# an error reply must not grow the engine by 1 GiB).
MAX_ERROR_BYTES = SCRATCH_BYTES
# Replies that redis-py's cluster client must handle (MovedError is an AskError).
REDIRECTIONS = (AskError, TryAgainError, ClusterDownError)


@dataclass(frozen=True)
class ReadItem:
    """One key of a read batch: the ``STRLEN`` + ``GETRANGE 0 expected-1`` it needs."""

    name: bytes
    expected: int  # the record's bytes for the caller's buffer (header + data)
    offset: int  # header bytes: where the data starts in the record
    data: memoryview  # the host buffer (``expected - offset`` bytes)
    header_ok: Callable[[bytes], bool]  # whether a header is this key's (layout, size)


@dataclass(frozen=True)
class InPlace:
    """A value of the expected size: its header; its data is in the host buffer already,
    not yet verified."""

    head: bytes


class ProtocolError(redis.ConnectionError):
    """The server sent what these commands never answer: the connection is not trusted."""


class Unparsed(Exception):
    """A reply this reader leaves to redis-py (e.g. a RESP3 push message): the caller closes
    the connection and runs the batch through redis-py's pipeline."""


class _Replies:
    """RESP2 replies from one socket, through a small scratch buffer."""

    def __init__(self, sock) -> None:
        self._sock = sock
        self._buf = bytearray(SCRATCH_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # (a partial line at the end: move it to the front)
            kept = self._end - self._start
            self._view[:kept] = self._view[self._start:self._end]
            self._start, self._end = 0, kept
        n = self._sock.recv_into(self._view[self._end:])
        if not n:
            raise redis.ConnectionError("Connection closed by server.")
        self._end += n

    def line(self) -> bytes:
        while True:
            i = self._buf.find(CRLF, self._start, self._end)
            if i >= 0:
                line = bytes(self._view[self._start:i])
                self._start = i + 2
                return line
            if self._end - self._start >= len(self._buf):
                raise ProtocolError("a reply line longer than the scratch buffer")
            self._fill()

    def into(self, out: memoryview) -> None:
        """Exactly ``len(out)`` bytes of reply into ``out``: what is buffered, then straight
        from the socket (the kernel's copy is the only one)."""
        have = min(self._end - self._start, len(out))
        out[:have] = self._view[self._start:self._start + have]
        self._start += have
        while have < len(out):
            n = self._sock.recv_into(out[have:])
            if not n:
                raise redis.ConnectionError("Connection closed by server.")
            have += n

    def crlf(self) -> None:
        end = bytearray(2)
        self.into(memoryview(end))
        if end != CRLF:
            raise ProtocolError("a bulk reply not ended by CRLF")

    def _error(self, line: bytes) -> Exception | None:
        """The error a ``-`` (RESP2/3) or ``!`` (RESP3 blob error) line carries, if it is one."""
        if line[:1] == b"-":
            return _parse_error(line[1:].decode("utf-8", "replace"))
        if line[:1] == b"!":
            n = _number(line)
            if not 0 <= n <= MAX_ERROR_BYTES:
                raise ProtocolError(f"an error reply of {n} bytes (at most {MAX_ERROR_BYTES} "
                                    f"are read)")
            text = bytearray(n)
            self.into(memoryview(text))
            self.crlf()
            return _parse_error(text.decode("utf-8", "replace"))
        if line[:1] not in (b":", b"$", b"_"):  # (push, attribute...: redis-py's to handle)
            raise Unparsed(f"a reply of type {line[:1]!r}")
        return None

    def integer(self) -> int | Exception:
        line = self.line()
        error = self._error(line)
        if error is not None:
            return error
        if line[:1] == b":":
            n = _number(line)
            if n < 0:  # (STRLEN is a length)
                raise ProtocolError(f"a negative length {n} in an integer reply")
            return n
        raise ProtocolError(f"expected an integer reply, got {line[:16]!r}")

    def sized_bulk(self, item: ReadItem, held: int | Exception) -> bytes | InPlace | Exception:
        """The ``GETRANGE`` reply of ``item`` (``held``: its ``STRLEN`` reply)."""
        line = self.line()
        error = self._error(line)
        if error is not None:
            return error
        if line[:1] == b"_":  # (RESP3 null; GETRANGE sends an empty string for no key)
            return b""
        if line[:1] != b"$":
            raise ProtocolError(f"expected a bulk reply, got {line[:16]!r}")
        n = _number(line)
        if n > item.expected:  # (GETRANGE never sends more: a server that does is not trusted)
            raise ProtocolError(f"{n} bytes sent for a range of {item.expected}")
        if n < 0:  # (a RESP2 null: GETRANGE answers a missing key with "", never null; read
            # as empty it would condemn (delete) the good record STRLEN just measured)
            raise ProtocolError(f"a null bulk reply ({n}) to GETRANGE")
        if n == item.expected == held:
            head = bytearray(item.offset)
            self.into(memoryview(head))
            if item.header_ok(bytes(head)):
                self.into(item.data)
                self.crlf()
                return InPlace(bytes(head))
            value = bytearray(n)  # not ours: whole, judged (and deleted) as before
            value[:item.offset] = head
            self.into(memoryview(value)[item.offset:])
            self.crlf()
            return bytes(value)
        value = bytearray(n)  # another size: its start, for judge_wrong_size
        self.into(memoryview(value))
        self.crlf()
        return bytes(value)


def _number(line: bytes) -> int:
    try:
        return int(line[1:])
    except ValueError:
        raise ProtocolError(f"not a number in the reply line {line[:16]!r}") from None


def read_sized(connection, items: list[ReadItem]) -> list[tuple]:
    """Send ``STRLEN`` + ``GETRANGE`` for every item on one redis-py ``connection`` and read
    the replies: per item ``(held, value)``, as the pipeline returns them except that a
    value of the expected size is an ``InPlace``. Raises on a socket failure or a reply
    these commands never give (the caller closes the connection)."""
    commands = []
    for item in items:
        commands += [("STRLEN", item.name), ("GETRANGE", item.name, 0, item.expected - 1)]
    connection.send_packed_command(connection.pack_commands(commands))
    sock = connection._sock  # (redis-py's socket: ours, deadline-bounded)
    if sock is None:  # (closed under us: a cluster client's topology refresh drops the
        # connections of the node it asked, in use or not)
        raise redis.ConnectionError("the connection was closed before its replies arrived")
    replies = _Replies(sock)
    out = []
    for item in items:
        held = replies.integer()
        out.append((held, replies.sized_bulk(item, held)))
    return out


def redirected(replies: list[tuple]) -> bool:
    """Whether a reply asks redis-py's cluster client to route the batch again."""
    return any(isinstance(r, REDIRECTIONS) for pair in replies for r in pair)
