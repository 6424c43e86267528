"""Servers on loopback that answer reads by trickling bytes, for the request-deadline tests.

Real sockets, real protocols (just enough of them): a RESP server that answers the commands
a Valkey tier sends at start (HELLO, PING, CLIENT, SCAN, INFO) and the writes (EXISTS, SET), and an
HTTP server that answers S3's ListObjectsV2 and PutObject; a read (RESP: STRLEN, GETRANGE,
GET; HTTP: GET of an object) gets a reply header and then one byte every ``interval_s``, for
at most ``trickle_for_s`` (then the connection is closed, so a client without a deadline
ends eventually and its test fails on time instead of hanging). Each byte arrives well within
any per-read socket timeout: only a bound on the whole request ends such a read early.

`StallingS3Server` is the other shape of a stuck endpoint: it keeps what is PUT and serves
it back, but while ``stalled`` is set an object GET gets its reply header and then no byte
at all, until the test clears it (the real S3 server a test runs cannot stall on demand).
"""

from __future__ import annotations

import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import StreamRequestHandler, ThreadingTCPServer

READS = {b"STRLEN", b"GETRANGE", b"GET"}
# The Valkey tier's start-up check reads a key that does not exist: answered at once, as a
# real server would (only values trickle).
ABSENT = b"access-check"
LISTING = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult '
           b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name><Prefix></Prefix>'
           b"<KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>"
           b"</ListBucketResult>")


def accept_put(handler: BaseHTTPRequestHandler) -> bytes:
    """Take a PUT's body and answer it as S3 does (200, an ETag); the body."""
    body = handler.rfile.read(int(handler.headers.get("Content-Length", 0)))
    handler.send_response(200)
    handler.send_header("ETag", '"0"')
    handler.send_header("Content-Length", "0")
    handler.end_headers()
    return body


def answered_listing(handler: BaseHTTPRequestHandler) -> bool:
    """Answer a ListObjectsV2 GET with an empty listing; whether the GET was one."""
    if "list-type=2" not in handler.path:
        return False
    handler.send_response(200)
    handler.send_header("Content-Type", "application/xml")
    handler.send_header("Content-Length", str(len(LISTING)))
    handler.end_headers()
    handler.wfile.write(LISTING)
    return True


class _Trickle:
    def __init__(self, interval_s: float, trickle_for_s: float) -> None:
        self.interval_s = interval_s
        self.trickle_for_s = trickle_for_s
        self.stop = threading.Event()
        self.trickles_started = 0

    def drip(self, out) -> None:
        self.trickles_started += 1
        end = time.monotonic() + self.trickle_for_s
        try:
            while time.monotonic() < end and not self.stop.wait(self.interval_s):
                out.write(b"x")
                out.flush()
        except OSError:
            pass  # the client gave up: what the test wants


def _read_command(rfile) -> list[bytes] | None:
    """One RESP array of bulk strings (what redis-py sends), or None at EOF."""
    line = rfile.readline()
    if not line:
        return None
    count = int(line[1:])
    args = []
    for _ in range(count):
        size = int(rfile.readline()[1:])
        args.append(rfile.read(size + 2)[:-2])
    return args


class _Serving:
    """A loopback socket server run on a daemon thread, as a context manager; ``stop`` is
    set when it ends (its handlers' waits end with it)."""

    stop: threading.Event

    def _serve(self, server) -> None:
        server.daemon_threads = True
        self._server, self.port = server, server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._server.shutdown()
        self._server.server_close()


class TrickleRespServer(_Serving):
    """A RESP server on 127.0.0.1 whose read replies trickle (a context manager)."""

    def __init__(self, interval_s: float = 0.2, trickle_for_s: float = 20.0) -> None:
        trickle = self.trickle = _Trickle(interval_s, trickle_for_s)
        self.stop = trickle.stop

        class Handler(StreamRequestHandler):
            def handle(self) -> None:
                while (args := _read_command(self.rfile)) is not None:
                    name = args[0].upper()
                    if name in READS and args[1].endswith(ABSENT):
                        self.wfile.write(_absent(name))  # (no value: nothing to trickle)
                        self.wfile.flush()
                        continue
                    if name in READS:
                        self.wfile.write(b"$100000\r\n")
                        trickle.drip(self.wfile)
                        return
                    self.wfile.write(_reply(name))
                    self.wfile.flush()

        ThreadingTCPServer.allow_reuse_address = True
        self._serve(ThreadingTCPServer(("127.0.0.1", 0), Handler))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def _absent(name: bytes) -> bytes:
    return {b"STRLEN": b":0\r\n", b"GETRANGE": b"$0\r\n\r\n"}.get(name, b"_\r\n")


def _reply(name: bytes) -> bytes:
    if name == b"HELLO":  # (redis-py 8 speaks RESP3: a map that says so)
        return b"%1\r\n$5\r\nproto\r\n:3\r\n"
    if name == b"PING":
        return b"+PONG\r\n"
    if name == b"SCAN":
        return b"*2\r\n$1\r\n0\r\n*0\r\n"
    if name == b"INFO":
        body = b"# Memory\r\nused_memory:0\r\nmaxmemory:0\r\n"
        return b"$%d\r\n%s\r\n" % (len(body), body)
    if name == b"EXISTS":
        return b":0\r\n"
    return b"+OK\r\n"  # CLIENT SETINFO, SET, ...


class TrickleS3Server(_Serving):
    """An HTTP server on 127.0.0.1 that stores nothing, lists nothing, accepts every PUT
    and answers every object GET by trickling its body (a context manager)."""

    def __init__(self, interval_s: float = 0.2, trickle_for_s: float = 20.0) -> None:
        trickle = self.trickle = _Trickle(interval_s, trickle_for_s)
        self.stop = trickle.stop

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
                accept_put(self)

            def do_GET(self) -> None:  # noqa: N802
                if answered_listing(self):
                    return
                size = 100_000
                self.send_response(206)
                self.send_header("Content-Length", str(size))
                self.send_header("Content-Range", f"bytes 0-{size - 1}/{size}")
                self.end_headers()
                trickle.drip(self.wfile)
                self.close_connection = True

        self._serve(ThreadingHTTPServer(("127.0.0.1", 0), Handler))

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class StallingS3Server(_Serving):
    """An HTTP server on 127.0.0.1 that keeps PUT objects in memory and serves ranged GETs
    of them, except that while ``stalled`` is set a GET sends its reply header and then
    stalls (no body byte) until the stall is lifted or ``stall_for_s`` passed, and drops
    the connection (a context manager)."""

    def __init__(self, stall_for_s: float = 20.0) -> None:
        self.stalled = threading.Event()
        self.object_gets = 0  # GETs of an object that reached the server
        self.stop = threading.Event()
        objects: dict[str, bytes] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
                objects[self.path.split("?")[0]] = accept_put(self)

            def do_GET(self) -> None:  # noqa: N802
                if answered_listing(self):
                    return
                server.object_gets += 1
                stored = objects.get(self.path.split("?")[0], b"")
                asked = re.fullmatch(r"bytes=0-(\d+)", self.headers.get("Range", ""))
                part = stored[:int(asked[1]) + 1] if asked else stored
                self.send_response(206)
                self.send_header("Content-Length", str(len(part)))
                self.send_header("Content-Range", f"bytes 0-{len(part) - 1}/{len(stored)}")
                self.end_headers()
                if server.stalled.is_set():
                    self.wfile.flush()
                    end = time.monotonic() + stall_for_s
                    while (server.stalled.is_set() and time.monotonic() < end
                           and not server.stop.wait(0.05)):
                        pass
                    self.close_connection = True  # (the body never comes)
                    return
                self.wfile.write(part)

        self._serve(ThreadingHTTPServer(("127.0.0.1", 0), Handler))

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
