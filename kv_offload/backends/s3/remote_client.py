"""`HelperClient`: the S3 tier's client when its requests run in a helper process.

It has the methods of a boto3 S3 client that the tier calls (``put_object``,
``get_object``, ``head_object``, ``delete_object``, ``delete_objects``,
``list_objects_v2``), with the same
arguments, replies and exceptions (``ClientError`` with the store's code, ``BotoCoreError``,
``OSError``), so the tier's code is the same either way. Each call sends its request to the
helper process (helper.py: the protocol) over a channel of its own and waits, off the
interpreter lock, for the reply: what the engine's process spends per request is a pickle
and two socket writes (tens of microseconds) instead of botocore's ~4 ms.

- **Channels**: one per call in flight, kept for reuse (the tier's I/O threads, its listing
  and its deletes each hold at most one at a time); a channel whose call did not end
  cleanly is closed, never reused, so a late reply can never answer the next request.
- **Bounds**: the helper runs each request under the caller's deadline
  (`deadline.request_deadline`, else ``request_timeout_s``) with the tier's deadline
  sockets; this side waits that long plus `GRACE_S` and then raises ``TimeoutError``. A
  helper that is alive but stopped (SIGSTOP, swapped out) reads nothing, so every socket
  operation on this side is bounded too: the channel's ``SO_SNDTIMEO``/``SO_RCVTIMEO`` are
  set to the same bound before each call, which covers the connect and the key handshake
  of a new channel and a body larger than the socket's buffer.
- **A helper that died** (killed, out of memory): calls fail with `HelperGone` (an
  ``OSError``: the tier counts a miss and opens an outage episode), and the next call at
  least `RESTART_INTERVAL_S` after the last start starts a new helper (logged).
- **Start**: the constructor starts the helper and waits for it (about 0.3 s: it imports
  boto3, not torch); a helper that does not come up is a `HelperStartError` naming why.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import fields
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from kv_offload.backends.common.deadline import current_deadline
from kv_offload.backends.s3.config import S3TierConfig

logger = logging.getLogger(__name__)

HELPER = Path(__file__).with_name("helper.py")
START_TIMEOUT_S = 30.0
GRACE_S = 2.0  # past the request's own deadline, for the reply to come back
RESTART_INTERVAL_S = 1.0
# The options the helper's client is made from (never the codec: no secret leaves).
CLIENT_OPTIONS = ("bucket", "bytes_to_use", "layout_fingerprint", "endpoint_url", "region_name",
                  "addressing_style", "connections", "timeout_s", "request_timeout_s",
                  "connect_timeout_s", "max_attempts")


class HelperGone(ConnectionError):
    """The helper process is not there to answer (killed, crashed, not restarted yet)."""


class HelperStartError(RuntimeError):
    """The helper process did not start."""


class HelperRequestError(BotoCoreError):
    """A botocore error raised in the helper process (its type and text)."""

    fmt = "{message}"


class HelperClient:
    """An S3 client whose requests run in a helper process (see the module docstring)."""

    def __init__(self, config: S3TierConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        self._free: list[_Channel] = []
        self._process: subprocess.Popen | None = None
        self._started_at = 0.0
        self._closed = False
        self._workdir = tempfile.mkdtemp(prefix="kv-offload-s3-helper-")  # (mode 0700)
        self._address = os.path.join(self._workdir, "socket")
        self._authkey = b""
        self._start()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    # -- the client's methods ------------------------------------------------------------

    def put_object(self, **kwargs):
        return self._call("put_object", kwargs)

    def get_object(self, **kwargs):
        return self._call("get_object", kwargs)

    def head_object(self, **kwargs):
        return self._call("head_object", kwargs)

    def delete_object(self, **kwargs):
        return self._call("delete_object", kwargs)

    def delete_objects(self, **kwargs):
        return self._call("delete_objects", kwargs)

    def list_objects_v2(self, **kwargs):
        return self._call("list_objects_v2", kwargs)

    def close(self) -> None:
        """Stop the helper (its requests in flight end with it) and remove its socket."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
            process = self._process
        for channel in free:
            channel.close()
        if process is not None:
            _stop(process)
        shutil.rmtree(self._workdir, ignore_errors=True)

    # -- internals -------------------------------------------------------------------------

    def _call(self, method: str, kwargs: dict):
        deadline = current_deadline()
        timeout_s = (max(0.0, deadline - time.monotonic()) if deadline is not None
                     else self._config.request_timeout_s)
        bound_s = timeout_s + GRACE_S
        body = kwargs.pop("Body", None)
        channel = None
        clean = False
        try:
            channel = self._channel(bound_s)
            channel.bound(bound_s)
            connection = channel.connection
            connection.send_bytes(pickle.dumps((method, kwargs, timeout_s, body is not None)))
            if body is not None:
                connection.send_bytes(body)
            if not connection.poll(bound_s):
                raise TimeoutError(f"the S3 helper process gave no reply to {method} within "
                                   f"{bound_s:.1f} s")
            outcome, value, has_body = pickle.loads(connection.recv_bytes())
            if has_body and not connection.poll(GRACE_S):  # (sent right after the header)
                raise TimeoutError(f"the S3 helper process sent the reply to {method} "
                                   f"without its body within {GRACE_S:.1f} s")
            reply_body = connection.recv_bytes() if has_body else None
            clean = True
        except (EOFError, OSError) as e:
            if isinstance(e, TimeoutError):
                raise
            if isinstance(e, BlockingIOError):  # (a socket operation ran past its bound)
                raise TimeoutError(f"the S3 helper process took no bytes of {method} for "
                                   f"{bound_s:.1f} s (stopped?)") from None
            raise HelperGone(f"the S3 helper process (pid {self.pid}) is gone: "
                             f"{type(e).__name__}: {e}") from None
        finally:
            if clean:
                with self._lock:
                    self._free.append(channel)
            elif channel is not None:
                channel.close()
        return _result(method, outcome, value, reply_body)

    def _channel(self, bound_s: float) -> _Channel:
        with self._lock:
            if self._closed:
                raise HelperGone("the S3 tier's helper process was stopped (tier closed)")
            if self._process is None or self._process.poll() is not None:
                self._restart_locked()  # (its channels all led to the dead one)
            if self._free:
                return self._free.pop()
            address, authkey = self._address, self._authkey
        return _Channel.open(address, authkey, bound_s)

    def _restart_locked(self) -> None:
        since = time.monotonic() - self._started_at
        if since < RESTART_INTERVAL_S:
            raise HelperGone(f"the S3 helper process (pid {self.pid}) exited; a new one "
                             f"starts at the next call after {RESTART_INTERVAL_S} s")
        code = self._process.poll() if self._process else None
        logger.warning("kv-offload S3 tier: its helper process (pid %s) exited (code %s); "
                       "starting a new one", self.pid, code)
        for channel in self._free:
            channel.close()
        self._free.clear()
        if self._process is not None:
            _stop(self._process)  # (dead already: its pipes closed, not leaked)
        try:
            self._start()
        except HelperStartError as e:
            raise HelperGone(str(e)) from None

    def _start(self) -> None:
        self._started_at = time.monotonic()
        self._authkey = os.urandom(32)
        if os.path.exists(self._address):
            os.unlink(self._address)  # (the last helper's)
        settings = {
            "address": self._address, "authkey": self._authkey.hex(),
            "sys_path": [p for p in sys.path if isinstance(p, str)],
            "nice": self._config.helper_nice,
            "client": {f.name: getattr(self._config, f.name) for f in fields(self._config)
                       if f.name in CLIENT_OPTIONS}}
        process = subprocess.Popen([sys.executable, str(HELPER)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, close_fds=True)
        self._process = process
        process.stdin.write(json.dumps(settings).encode() + b"\n")
        process.stdin.flush()  # (stdin stays open: the helper's lifeline)
        ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
        line = process.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            if ready and not line:  # (its stdout ended: it is exiting)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=2.0)
            code = process.poll()
            _stop(process)
            what = (f"exited with code {code} before it was ready (its error is on stderr "
                    f"above)" if code is not None else
                    f"was not ready within {START_TIMEOUT_S:.0f} s")
            raise HelperStartError(
                f"kv-offload S3 tier: its helper process ({sys.executable} {HELPER}) {what}. "
                f"Set storage_options.helper_process: false to run the requests in the "
                f"engine's process instead")


class _Channel:
    """One authenticated channel to the helper, with its socket kept to bound each call."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.connection = Connection(os.dup(sock.fileno()))  # (the same socket)

    @classmethod
    def open(cls, address: str, authkey: bytes, bound_s: float) -> _Channel:
        """Connect and run the key handshake, each wait bounded by ``bound_s``."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        channel = None
        try:
            channel = cls(sock)
            channel.bound(bound_s)
            sock.connect(address)
            answer_challenge(channel.connection, authkey)  # (what multiprocessing's
            deliver_challenge(channel.connection, authkey)  # Client() runs, bounded here)
            return channel
        except BaseException:
            if channel is not None:
                channel.close()
            else:
                sock.close()
            raise

    def bound(self, seconds: float) -> None:
        """Fail any send or receive that waits ``seconds`` for the peer with EAGAIN (the
        kernel's timeouts: they hold for the plain reads and writes `Connection` makes)."""
        whole = int(seconds)
        micros = max(int((seconds - whole) * 1e6), 0 if whole else 1)  # (0 s: no bound)
        timeval = struct.pack("ll", whole, micros)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)

    def close(self) -> None:
        self.connection.close()
        self.sock.close()


def _result(method: str, outcome: str, value, body: bytes | None):
    """The reply (or the exception) the boto3 client itself would have given."""
    if outcome == "ok":
        if method == "get_object":
            value["Body"] = io.BytesIO(body or b"")  # (a stream: read(n), with-block, close)
        return value
    if outcome == "client_error":
        response, operation = value
        raise ClientError(response, operation)
    if outcome == "botocore_error":
        raise HelperRequestError(message=value)
    if outcome == "os_error":
        raise OSError(*value)
    raise RuntimeError(f"the S3 helper process raised running {method}:\n{value}")


def _stop(process: subprocess.Popen) -> None:
    """End the helper: close its lifeline, then kill it if it has not gone in 2 s."""
    with contextlib.suppress(OSError):
        process.stdin.close()
    try:
        process.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    process.stdout.close()
