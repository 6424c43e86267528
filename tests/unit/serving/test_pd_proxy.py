"""The P/D proxy (`kv-offload proxy`) between a client and real HTTP servers on loopback.

vLLM engines take far too long to start for a unit test, so the prefill and decode servers
here are small stdlib HTTP servers written from vLLM's documented OpenAI-compatible
behaviour, independently of the proxy (another HTTP stack, no shared code): a prefill
server answers a non-streamed completion with a top-level `kv_transfer_params`; a decode
server answers with JSON, or with Server-Sent Events when asked to stream, and both record
every request. The lead engineer's end-to-end test runs the proxy against real vLLM servers.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import kv_offload

httpx = pytest.importorskip("httpx", reason="the proxy needs httpx (pip install -e '.[proxy]')")
pytest.importorskip("starlette", reason="the proxy needs starlette (pip install -e '.[proxy]')")
pytest.importorskip("uvicorn", reason="the proxy needs uvicorn (pip install -e '.[proxy]')")

from kv_offload.serving.pd_proxy import ProxySettings, build_server  # noqa: E402

REPO = Path(kv_offload.__file__).resolve().parent.parent
WAIT_S = 10.0  # longest any step may take before a test fails (loaded 2-core machine)
COMPLETION = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 16,
              "temperature": 0.0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}],
        "max_completion_tokens": 16}


class Backend:
    """One stdlib HTTP server playing a vLLM prefill or decode server.

    prefill: answers POSTs with a one-choice completion whose `kv_transfer_params` is
    `params` (None: JSON null, as vLLM sends without a P/D connector), or with `status` and
    an OpenAI-style error body. decode: answers with a completion naming itself, or, when the
    body says `"stream": true`, with an SSE chunk, then (once `release` is set, or after
    WAIT_S) a second chunk and `data: [DONE]`. Both answer GET /v1/models and /health."""

    def __init__(self, name: str, role: str, journal: list[str], *, status: int = 200,
                 params: dict[str, Any] | None | str = "default") -> None:
        self.name, self.role, self.status = name, role, status
        self.params = {"remote_server": name, "blocks": [3, 5, 8]} if params == "default" \
            else params
        self.received: list[dict[str, Any]] = []  # {"path", "body", "headers"}
        self.release = threading.Event()
        self.released_by_client: bool | None = None
        self._journal = journal
        backend = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                backend._record(self, None)
                if self.path == "/health":
                    self._send(200, b"", "text/plain")
                else:
                    self._send_json(200, {"object": "list", "data": [
                        {"id": "tiny", "object": "model", "owned_by": backend.name}]})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                try:
                    body = json.loads(raw)
                except ValueError:
                    backend._record(self, raw.decode(errors="replace"))
                    self._send_json(400, _error("invalid JSON body", 400))
                    return
                backend._record(self, body)
                if backend.status != 200:
                    self._send_json(backend.status, _error(f"{backend.name} says no",
                                                           backend.status))
                elif backend.role == "prefill":
                    self._send_json(200, _completion(backend.name, body,
                                                     backend.params))
                elif body.get("stream"):
                    self._stream(body)
                else:
                    self._send_json(200, _completion(backend.name, body, None))

            def _stream(self, body: dict[str, Any]) -> None:
                # HTTP/1.0 (the handler's default): no length, the body ends when the
                # connection closes, and each write goes out at once (unbuffered wfile)
                self.send_response(200)
                self.send_header("content-type", "text/event-stream; charset=utf-8")
                self.end_headers()
                self.wfile.write(_sse({"choices": [{"index": 0, "text": "first"}]}))
                backend.released_by_client = backend.release.wait(WAIT_S)
                self.wfile.write(_sse({"choices": [{"index": 0, "text": "second"}]}))
                self.wfile.write(b"data: [DONE]\n\n")

            def _send_json(self, status: int, document: dict[str, Any]) -> None:
                self._send(status, json.dumps(document).encode(), "application/json")

            def _send(self, status: int, content: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _record(self, handler: BaseHTTPRequestHandler, body: Any) -> None:
        self.received.append({"path": handler.path, "body": body,
                              "headers": {k.lower(): v for k, v in handler.headers.items()}})
        self._journal.append(self.name)

    def stop(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()


def _completion(name: str, body: dict[str, Any], params: Any) -> dict[str, Any]:
    chat = "messages" in body
    choice = {"index": 0, "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": f"from {name}"}
    else:
        choice["text"] = f"from {name}"
    return {"id": f"cmpl-{name}", "object": "chat.completion" if chat else "text_completion",
            "model": body.get("model"), "choices": [choice],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
            "kv_transfer_params": params}


def _error(message: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequestError", "code": status}}


def _sse(document: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(document)}\n\n".encode()


@pytest.fixture
def journal() -> list[str]:
    """Which backend got each request, in order (all backends of a test append here)."""
    return []


@pytest.fixture
def backend(journal: list[str]) -> Iterator[Callable[..., Backend]]:
    started: list[Backend] = []

    def start(name: str, role: str, **kw: Any) -> Backend:
        started.append(Backend(name, role, journal, **kw))
        return started[-1]

    yield start
    for b in started:
        b.stop()


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A loopback port bound but never listening: every connection is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def proxy() -> Iterator[Callable[..., str]]:
    """Start the proxy in this process (a uvicorn server in a thread, on a socket bound to a
    free loopback port); returns its URL."""
    running: list[tuple[Any, threading.Thread]] = []

    def start(prefill: list[str], decode: list[str]) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = build_server(ProxySettings.from_urls(prefill, decode, timeout_s=WAIT_S),
                              "127.0.0.1", port)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        running.append((server, thread))
        deadline = time.monotonic() + WAIT_S
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(WAIT_S)


def post(url: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, timeout=WAIT_S,
                      headers={"content-type": "application/json", **kw.pop("headers", {})},
                      **kw)


def test_a_completion_is_prefilled_for_one_token_then_decoded_with_the_prefill_params(
        backend, proxy):
    prefill, decode = backend("P", "prefill"), backend("D", "decode")
    url = proxy([prefill.url], [decode.url])
    sent = {**COMPLETION, "min_tokens": 4, "kv_transfer_params": {"client_hint": "x"}}

    answer = post(url, "/v1/completions", sent)

    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kv-offload-prefill"] == "ok"
    assert answer.headers["content-type"] == "application/json"
    assert answer.json()["choices"][0]["text"] == "from D"
    [asked_prefill] = prefill.received
    assert asked_prefill["path"] == "/v1/completions"
    # one token, not streamed, min_tokens gone (vLLM refuses min_tokens > max_tokens), and
    # the connector told to keep the KV for a remote decode, the client's own params kept
    expected = {k: v for k, v in sent.items() if k != "min_tokens"}
    assert asked_prefill["body"] == {
        **expected, "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"client_hint": "x", "do_remote_decode": True,
                               "do_remote_prefill": False}}
    [asked_decode] = decode.received
    assert asked_decode["body"] == {**sent, "kv_transfer_params": prefill.params}


def test_a_chat_completion_asks_prefill_for_one_completion_token_without_stream_options(
        backend, proxy):
    prefill, decode = backend("P", "prefill"), backend("D", "decode")
    url = proxy([prefill.url], [decode.url])
    sent = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    decode.release.set()  # (streaming itself is the next test's)

    answer = post(url, "/v1/chat/completions", sent)

    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kv-offload-prefill"] == "ok"
    [asked_prefill] = prefill.received
    assert asked_prefill["path"] == "/v1/chat/completions"
    assert asked_prefill["body"] == {
        "model": "tiny", "messages": CHAT["messages"], "max_tokens": 1,
        "max_completion_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    [asked_decode] = decode.received
    assert asked_decode["path"] == "/v1/chat/completions"
    assert asked_decode["body"] == {**sent, "kv_transfer_params": prefill.params}


def test_a_chat_completion_with_max_tokens_only_gets_no_max_completion_tokens(backend, proxy):
    prefill, decode = backend("P", "prefill"), backend("D", "decode")
    url = proxy([prefill.url], [decode.url])
    sent = {"model": "tiny", "messages": CHAT["messages"], "max_tokens": 9}

    assert post(url, "/v1/chat/completions", sent).status_code == 200
    body = prefill.received[0]["body"]
    assert body["max_tokens"] == 1 and "max_completion_tokens" not in body


def test_a_streamed_answer_reaches_the_client_chunk_by_chunk_as_the_decode_server_sends_it(
        backend, proxy):
    prefill, decode = backend("P", "prefill"), backend("D", "decode")
    url = proxy([prefill.url], [decode.url])
    events: list[str] = []

    with httpx.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True},
                      timeout=WAIT_S) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        assert answer.headers["x-kv-offload-prefill"] == "ok"
        for line in answer.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 1:
                # the decode server holds its second chunk back until this: a proxy that
                # gathered the body would block here until WAIT_S, then fail below
                assert decode.released_by_client is None
                decode.release.set()

    assert decode.released_by_client is True
    assert [e for e in events if "[DONE]" not in e] == [
        _sse({"choices": [{"index": 0, "text": t}]}).decode().strip() for t in
        ("first", "second")]
    assert events[-1] == "data: [DONE]"
    assert prefill.received[0]["body"]["stream"] is False


def test_a_prefill_answer_without_params_sends_decode_none(backend, proxy):
    prefill, decode = backend("P", "prefill", params=None), backend("D", "decode")
    url = proxy([prefill.url], [decode.url])

    answer = post(url, "/v1/completions", COMPLETION)

    assert answer.status_code == 200 and answer.headers["x-kv-offload-prefill"] == "ok"
    assert decode.received[0]["body"] == COMPLETION  # no kv_transfer_params key at all


def test_a_failing_prefill_server_leaves_the_decode_server_to_compute_and_says_failed(
        backend, proxy, caplog):
    prefill, decode = backend("P", "prefill", status=503), backend("D", "decode")
    url = proxy([prefill.url], [decode.url])

    with caplog.at_level(logging.INFO, logger="kv_offload.serving.pd_proxy"):
        answer = post(url, "/v1/completions", COMPLETION)

    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kv-offload-prefill"] == "failed"
    assert answer.json()["choices"][0]["text"] == "from D"
    assert len(prefill.received) == 1
    assert decode.received[0]["body"] == COMPLETION
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(prefill.url in m and "HTTP 503" in m and "computes the prompt itself" in m
               for m in warning), warning


def test_an_unreachable_prefill_server_leaves_the_decode_server_to_compute(
        backend, proxy, dead_url):
    decode = backend("D", "decode")
    url = proxy([dead_url], [decode.url])

    answer = post(url, "/v1/completions", COMPLETION)

    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kv-offload-prefill"] == "failed"
    assert decode.received[0]["body"] == COMPLETION


def test_an_unreachable_decode_server_gives_502_with_a_json_error(backend, proxy, dead_url):
    prefill = backend("P", "prefill")
    url = proxy([prefill.url], [dead_url])

    answer = post(url, "/v1/completions", {**COMPLETION, "stream": True})

    assert answer.status_code == 502
    assert answer.headers["content-type"] == "application/json"
    assert answer.headers["x-kv-offload-prefill"] == "ok"
    error = answer.json()["error"]
    assert error["code"] == 502 and dead_url in error["message"]


def test_a_decode_server_error_reaches_the_client_with_its_status_and_body(backend, proxy):
    prefill, decode = backend("P", "prefill"), backend("D", "decode", status=400)
    url = proxy([prefill.url], [decode.url])

    answer = post(url, "/v1/completions", {**COMPLETION, "stream": True})

    assert answer.status_code == 400
    assert answer.json() == _error("D says no", 400)


def test_servers_of_each_kind_are_used_in_turn(backend, proxy, journal):
    p1, p2 = backend("P1", "prefill"), backend("P2", "prefill")
    d1, d2 = backend("D1", "decode"), backend("D2", "decode")
    url = proxy([p1.url, p2.url], [d1.url, d2.url])

    for _ in range(4):
        assert post(url, "/v1/completions", COMPLETION).status_code == 200

    assert journal == ["P1", "D1", "P2", "D2", "P1", "D1", "P2", "D2"]
    # each decode server got the params of the prefill server asked just before it
    assert [r["body"]["kv_transfer_params"]["remote_server"] for r in d1.received] == ["P1"] * 2
    assert [r["body"]["kv_transfer_params"]["remote_server"] for r in d2.received] == ["P2"] * 2


@pytest.mark.parametrize("path", ["/v1/models", "/health"])
def test_models_and_health_go_to_a_decode_server_and_skip_prefill(backend, proxy, path):
    prefill, decode = backend("P", "prefill"), backend("D", "decode")
    url = proxy([prefill.url], [decode.url])

    answer = httpx.get(url + path, timeout=WAIT_S)

    assert answer.status_code == 200
    assert answer.headers["x-kv-offload-prefill"] == "skipped"
    assert [r["path"] for r in decode.received] == [path] and prefill.received == []
    if path == "/v1/models":
        assert answer.json()["data"][0]["owned_by"] == "D"


def test_a_body_that_is_not_json_goes_to_decode_unchanged_for_its_own_error(backend, proxy):
    prefill, decode = backend("P", "prefill"), backend("D", "decode")
    url = proxy([prefill.url], [decode.url])

    answer = post(url, "/v1/completions", b"{not json")

    assert answer.status_code == 400 and answer.json()["error"]["message"] == "invalid JSON body"
    assert answer.headers["x-kv-offload-prefill"] == "skipped"
    assert prefill.received == [] and decode.received[0]["body"] == "{not json"


def test_both_servers_get_the_clients_api_key_and_one_request_id(backend, proxy):
    prefill, decode = backend("P", "prefill"), backend("D", "decode")
    url = proxy([prefill.url], [decode.url])

    answer = post(url, "/v1/completions", COMPLETION, headers={"authorization": "Bearer k1"})
    named = post(url, "/v1/completions", COMPLETION, headers={"x-request-id": "mine-7"})

    first = [b.received[0]["headers"] for b in (prefill, decode)]
    assert [h["authorization"] for h in first] == ["Bearer k1"] * 2
    assert first[0]["x-request-id"] == first[1]["x-request-id"] == answer.headers["x-request-id"]
    assert [b.received[1]["headers"]["x-request-id"] for b in (prefill, decode)] == ["mine-7"] * 2
    assert named.headers["x-request-id"] == "mine-7"


def test_each_request_logs_its_prefill_time_and_decode_first_byte_time(backend, proxy, caplog):
    prefill, decode = backend("P", "prefill"), backend("D", "decode")
    url = proxy([prefill.url], [decode.url])

    with caplog.at_level(logging.INFO, logger="kv_offload.serving.pd_proxy"):
        post(url, "/v1/completions", COMPLETION, headers={"x-request-id": "r1"})
        deadline = time.monotonic() + WAIT_S  # (logged as the body's last byte leaves)
        while not any("request r1" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline
            time.sleep(0.01)

    [line] = [r.getMessage() for r in caplog.records if "request r1" in r.getMessage()]
    assert f"prefill ok {prefill.url}" in line and f"decode {decode.url} HTTP 200" in line
    assert " ms, decode " in line and "first byte " in line and "total " in line


def proxy_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kv_offload.tools.cli", "proxy", *args]


def cli_env() -> dict[str, str]:
    path = [str(REPO), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def test_the_command_serves_a_completion_and_logs_the_request(backend, tmp_path):
    prefill, decode = backend("P", "prefill"), backend("D", "decode")
    with socket.socket() as s:  # a free port (another process could take it: unlikely)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "proxy.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(proxy_command("--prefill", prefill.url + "/v1/", "--decode",
                                              decode.url, "--port", str(port)),
                                env=cli_env(), stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        answer = post(url, "/v1/completions", COMPLETION)
        assert answer.status_code == 200 and answer.headers["x-kv-offload-prefill"] == "ok"
        assert decode.received[-1]["body"]["kv_transfer_params"] == prefill.params
    finally:
        proc.terminate()
        proc.wait(WAIT_S)
    text = log.read_text()
    assert f"P/D proxy: prefill {prefill.url}, decode {decode.url}" in text
    assert "POST /v1/completions request " in text and "prefill ok" in text, text


@pytest.mark.parametrize("args, message", [
    (["--prefill", "10.0.0.1:8100", "--decode", "http://h:1"],
     "'10.0.0.1:8100' must start with http:// or https://"),
    (["--prefill", "http://h:1", "--decode", "http://h:2", "--port", "70000"],
     "a port is a number from 1 to 65535"),
    (["--prefill", "http://h:1"], "the following arguments are required: --decode"),
])
def test_bad_flags_exit_2_with_the_reason_before_anything_listens(args, message, tmp_path):
    proc = subprocess.run(proxy_command(*args), env=cli_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: kv-offload proxy ")
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_a_missing_server_side_is_a_typed_error_naming_the_extra(monkeypatch):
    from kv_offload.errors import ProxyDependencyError

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` now fails
    with pytest.raises(ProxyDependencyError, match=r"uvicorn is missing.*kv-offload\[proxy\]"):
        build_server(ProxySettings.from_urls(["http://h:1"], ["http://h:2"]), "127.0.0.1", 1)
