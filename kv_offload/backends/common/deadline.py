"""A deadline on a whole request, however slowly the server sends its bytes.

A socket timeout bounds one wait for bytes, not a request: a server (or a middlebox) that
sends one byte a second never trips a 1 s timeout, so a reply of a few MiB could hold an I/O
thread for days, keep its host slots reserved and, at exit, keep the process alive. So every
request of a network tier runs inside ``request_deadline(seconds)``: a deadline kept per
thread, and the sockets of the tier's clients are ``DeadlineSocket``s, which before every
send or receive set the socket's timeout to what is left of it (at most the client's own
per-wait timeout) and raise ``socket.timeout`` once it has passed. The client libraries turn
that into their usual timeout error (redis-py's ``TimeoutError``, botocore's
``ReadTimeoutError``) and drop the connection, so the tier counts a miss as for any stalled
server, and its ``Outage`` makes the next jobs fail fast.

How the sockets get there (no library has a hook for a total deadline):
- redis-py: ``deadline_connection_class(url)`` is a subclass of the connection class the URL
  asks for whose ``_connect`` wraps the socket it made; passed as ``connection_class``.
- boto3: ``install_deadlines(client)`` swaps the client's urllib3 connection-pool classes for
  subclasses whose connections wrap their socket once connected (TLS included: the wrap is of
  the TLS socket). It uses botocore's ``http_session`` internals; where they changed it
  returns False and the tier logs that only the per-read timeout applies.

A thread without a deadline (``request_deadline`` not entered) keeps the plain per-wait
timeout: the wrapper then changes nothing.
"""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()


def current_deadline() -> float | None:
    """The monotonic time by which this thread's request must be done, or None."""
    return getattr(_local, "deadline", None)


@contextmanager
def request_deadline(seconds: float) -> Iterator[None]:
    """Every socket wait of a wrapped client inside this block ends ``seconds`` from now at
    the latest (nested blocks keep the earlier deadline)."""
    before = current_deadline()
    mine = time.monotonic() + seconds
    _local.deadline = mine if before is None else min(before, mine)
    try:
        yield
    finally:
        _local.deadline = before


class DeadlineSocket:
    """A socket whose every wait is bounded by the thread's request deadline (see above)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()  # the client's own per-wait timeout
        self._applied = self._timeout  # what the socket has now (settimeout is a syscall)

    def __getattr__(self, name: str):
        return getattr(self._sock, name)  # fileno, close, setsockopt, getpeercert...

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._apply(timeout)

    def _apply(self, timeout: float | None) -> None:
        if timeout != self._applied:
            self._sock.settimeout(timeout)
            self._applied = timeout

    def gettimeout(self) -> float | None:
        return self._timeout

    def _arm(self) -> None:
        deadline = current_deadline()
        if deadline is None:
            self._apply(self._timeout)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        if self._timeout == 0:  # a non-blocking poll (e.g. "is there a reply?"): keep it
            self._apply(0)
            return
        # (far from the deadline this is the client's timeout, unchanged: no syscall)
        self._apply(left if self._timeout is None or left < self._timeout else self._timeout)

    def recv(self, *args):
        self._arm()
        return self._sock.recv(*args)

    def recv_into(self, *args):
        self._arm()
        return self._sock.recv_into(*args)

    def send(self, *args):
        self._arm()
        return self._sock.send(*args)

    def sendall(self, *args):
        self._arm()  # (sendall's timeout bounds the whole call, not each send)
        return self._sock.sendall(*args)

    def makefile(self, mode: str = "r", buffering: int | None = None, **_kw):
        """A binary file whose reads go through ``recv_into`` above (http.client reads a
        response through ``makefile("rb")``)."""
        if "b" not in mode or "w" in mode:
            raise ValueError(f"DeadlineSocket.makefile supports binary reads only, got {mode!r}")
        raw = socket.SocketIO(self, "rb")
        # As socket.makefile does: the fd stays open until this file is closed too
        # (http.client closes the socket while the response is still being read).
        self._sock._io_refs += 1
        if buffering == 0:
            return raw
        return io.BufferedReader(raw, io.DEFAULT_BUFFER_SIZE if not buffering or buffering < 0
                                 else buffering)


def deadline_connection_class(url: str):
    """The redis-py connection class ``url`` needs, with deadline-bounded sockets."""
    from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection

    base = {"unix": UnixDomainSocketConnection, "rediss": SSLConnection}.get(
        url.split("://", 1)[0], Connection)
    return _REDIS_CLASSES.setdefault(base, type(f"Deadline{base.__name__}", (base,), {
        "_connect": lambda self: DeadlineSocket(base._connect(self)),
        "__doc__": f"{base.__name__} whose socket waits end at the request's deadline."}))


_REDIS_CLASSES: dict[type, type] = {}


def install_deadlines(client) -> bool:
    """Make every connection of a boto3 client deadline-bounded; False if botocore's
    internals are not what this expects (then only the per-read timeout applies)."""
    try:
        from botocore.awsrequest import AWSHTTPConnectionPool, AWSHTTPSConnectionPool

        classes = client._endpoint.http_session._pool_classes_by_scheme
    except (AttributeError, ImportError):
        return False
    if not isinstance(classes, dict):
        return False
    # (In place: the session's pool managers, proxy ones included, share this dict.)
    classes["http"] = _pool_class(AWSHTTPConnectionPool)
    classes["https"] = _pool_class(AWSHTTPSConnectionPool)
    return True


def _pool_class(pool: type) -> type:
    base = pool.ConnectionCls

    def connect(self) -> None:
        base.connect(self)
        if not isinstance(self.sock, DeadlineSocket):
            self.sock = DeadlineSocket(self.sock)

    connection = type(f"Deadline{base.__name__}", (base,), {"connect": connect})
    return type(f"Deadline{pool.__name__}", (pool,), {"ConnectionCls": connection})
