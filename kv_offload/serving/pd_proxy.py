"""A reference proxy for prefill/decode disaggregation: one client request becomes a prefill
request to one server and a decode request to another (`kv-offload proxy`).

The flow is the one vLLM's disaggregated-serving examples and llm-d's routing sidecar use,
written here from vLLM's documented request semantics (no code taken from them):

1. A client POSTs `/v1/completions` or `/v1/chat/completions` to the proxy.
2. The proxy sends a prefill server (round-robin over `--prefill`) the same JSON body with
   `max_tokens: 1` (and `max_completion_tokens: 1` on chat when the client used that key),
   `stream: false`, no `stream_options`, and `kv_transfer_params` `{"do_remote_decode": true,
   "do_remote_prefill": false}` merged over any the client sent. With kv-offload as the KV
   connector, the prefill server computes the prompt's KV, stores it in the shared tier and
   returns in the response's top-level `kv_transfer_params` what the decode side needs.
3. The proxy sends a decode server (round-robin over `--decode`) the client's original body
   plus those `kv_transfer_params`, and returns the decode server's answer: its status, its
   content type, and its body as it arrives (SSE chunks are passed on one by one, never
   gathered, so the client's time to first token is the decode server's).

Why the prefill request asks for one token and no stream: vLLM runs the prompt's prefill and
samples one token, which is the least work that makes the connector store the prompt's KV;
a non-streamed answer is one JSON document whose `kv_transfer_params` can be read.
`min_tokens` is dropped from it because vLLM refuses `min_tokens` above `max_tokens`.

Failures degrade to plain serving rather than to an error: a prefill server that cannot be
reached, answers non-2xx or answers something that is not JSON makes the proxy send the
decode request without `kv_transfer_params` (the decode server then computes the prompt
itself), logs a warning and says `x-kv-offload-prefill: failed`. A decode server that
answers is passed through whatever its status; one that cannot be reached gives 502 (504 on
a timeout) with an OpenAI-style JSON error body. A body that is not a JSON object is sent to
the decode server unchanged (`skipped`): vLLM's own validation error is the right answer.
`GET /v1/models` and `GET /health` go to a decode server (`skipped` too).

Every response carries `x-kv-offload-prefill: ok|failed|skipped` and `x-request-id` (the
client's, or a new one, sent to both servers so their logs can be matched), and every
proxied completion logs one INFO line with the servers, the prefill time and the decode
server's time to its first body byte.

The server side is Starlette on uvicorn (what vLLM's own API server runs on, so any machine
with vLLM has them; the `proxy` extra installs them without vLLM), the client side one shared
`httpx.AsyncClient`. All are imported on use: `import kv_offload.serving.pd_proxy` needs none.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kv_offload.errors import ProxyDependencyError, ServingError
from kv_offload.serving.client import api_roots

logger = logging.getLogger(__name__)

PREFILL_HEADER = "x-kv-offload-prefill"
REQUEST_ID_HEADER = "x-request-id"
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
PASSTHROUGH_PATHS = ("/v1/models", "/health")
# Client headers the backends need: the API key (vLLM's --api-key) and the request id.
_FORWARDED_HEADERS = ("authorization",)


@dataclass(frozen=True)
class ProxySettings:
    """The servers behind the proxy (roots, `http://host:port`) and the per-request limit."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    timeout_s: float = 600.0

    @classmethod
    def from_urls(cls, prefill: Sequence[str], decode: Sequence[str],
                  timeout_s: float = 600.0) -> ProxySettings:
        """Settings from URLs as a user writes them (`http://h:p`, `http://h:p/v1`, a
        trailing slash); a URL without http(s):// raises ServingError naming it."""
        if not prefill or not decode:
            raise ServingError("the proxy needs at least one prefill and one decode server")
        if timeout_s <= 0:
            raise ServingError(f"the timeout must be positive, got {timeout_s}")
        return cls(tuple(api_roots(u)[0] for u in prefill),
                   tuple(api_roots(u)[0] for u in decode), timeout_s)


def prefill_request_body(body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """What the prefill server is asked: the client's request, one token, not streamed, with
    the connector told that another server decodes."""
    prefill = dict(body)
    prefill["max_tokens"] = 1
    if chat and "max_completion_tokens" in body:
        # vLLM's chat API prefers max_completion_tokens over max_tokens when both are set
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    prefill.pop("stream_options", None)  # vLLM refuses stream_options without stream
    prefill.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens
    client_params = body.get("kv_transfer_params")
    prefill["kv_transfer_params"] = {**(client_params if isinstance(client_params, dict) else {}),
                                     "do_remote_decode": True, "do_remote_prefill": False}
    return prefill


def decode_request_body(body: dict[str, Any],
                        kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """What the decode server is asked: the client's request as sent, plus the prefill
    server's `kv_transfer_params` when it returned any."""
    if kv_transfer_params is None:
        return body
    return {**body, "kv_transfer_params": kv_transfer_params}


class RoundRobin:
    """The next server of a list, in turn. The proxy runs on one event loop, so `next` is
    never called from two threads at once."""

    def __init__(self, servers: Sequence[str]) -> None:
        self._cycle: Iterator[str] = itertools.cycle(servers)

    def next(self) -> str:
        return next(self._cycle)


@dataclass
class _Prefill:
    """How the prefill step went, for the decode request, the header and the log line."""

    outcome: str  # "ok", "failed" or "skipped"
    server: str = "-"
    params: dict[str, Any] | None = None
    ms: float = 0.0
    reason: str = ""


def _require_server_side() -> Any:
    """uvicorn, once starlette and httpx are known to import too."""
    try:
        import httpx  # noqa: F401  (the client side, checked with the server side)
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise ProxyDependencyError(
            f"kv-offload proxy needs starlette, uvicorn and httpx ({e.name} is missing): "
            f"pip install 'kv-offload[proxy]' (vLLM's own install brings all three)") from None
    return uvicorn


def create_app(settings: ProxySettings) -> Any:
    """The proxy as an ASGI application (Starlette): routes, the shared HTTP client."""
    _require_server_side()
    import anyio
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    prefill_servers, decode_servers = RoundRobin(settings.prefill), RoundRobin(settings.decode)
    state: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        # No pool limit: the servers queue requests themselves, and a proxy that queued
        # them too would hide their queueing from their own metrics. trust_env=False: the
        # servers are internal; an HTTP(S)_PROXY meant for the internet must not route them.
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False)
        state["client"] = client
        logger.info("P/D proxy: prefill %s, decode %s", ", ".join(settings.prefill),
                    ", ".join(settings.decode))
        try:
            yield
        finally:
            await client.aclose()

    def backend_headers(request: Request, request_id: str) -> dict[str, str]:
        headers = {name: request.headers[name] for name in _FORWARDED_HEADERS
                   if name in request.headers}
        headers[REQUEST_ID_HEADER] = request_id
        headers["content-type"] = "application/json"
        # SSE must come back uncompressed, chunk by chunk, to be passed on as it arrives
        headers["accept-encoding"] = "identity"
        return headers

    def error(status: int, message: str, prefill: str, request_id: str) -> JSONResponse:
        kind = "bad_gateway" if status == 502 else "gateway_timeout"
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                            status_code=status,
                            headers={PREFILL_HEADER: prefill, REQUEST_ID_HEADER: request_id})

    async def run_prefill(path: str, body: dict[str, Any], chat: bool,
                          headers: dict[str, str]) -> _Prefill:
        server = prefill_servers.next()
        started = time.perf_counter()
        step = _Prefill("failed", server)
        try:
            answer = await state["client"].post(
                server + path, content=json.dumps(prefill_request_body(body, chat=chat)),
                headers=headers)
            if not answer.is_success:
                step.reason = f"HTTP {answer.status_code}: {answer.text[:200]}"
            else:
                document = answer.json()
                params = document.get("kv_transfer_params") \
                    if isinstance(document, dict) else None
                step.outcome = "ok"
                step.params = params if isinstance(params, dict) else None
        except httpx.HTTPError as e:
            step.reason = f"{type(e).__name__}: {e}"
        except ValueError:
            step.reason = "the answer is not JSON"
        step.ms = (time.perf_counter() - started) * 1e3
        if step.outcome == "failed":
            logger.warning("prefill server %s failed (%s); the decode server computes the "
                           "prompt itself", server, step.reason)
        return step

    async def proxied(server: str, path: str, method: str,
                      content: bytes | None, headers: dict[str, str], prefill: _Prefill,
                      request_id: str, stream: bool) -> Response:
        """The decode server's answer, passed on: streamed when the client streams."""
        started = time.perf_counter()
        upstream_request = state["client"].build_request(method, server + path,
                                                         content=content, headers=headers)
        try:
            upstream = await state["client"].send(upstream_request, stream=True)
        except httpx.TimeoutException as e:
            logger.warning("decode server %s timed out: %s", server, e)
            return error(504, f"the decode server {server} did not answer within "
                              f"{settings.timeout_s:g} s", prefill.outcome, request_id)
        except httpx.HTTPError as e:
            logger.warning("decode server %s cannot be reached: %s", server, e)
            return error(502, f"the decode server {server} cannot be reached: "
                              f"{type(e).__name__}: {e}", prefill.outcome, request_id)

        async def body() -> AsyncIterator[bytes]:
            first_byte_ms: float | None = None
            try:
                async for chunk in upstream.aiter_bytes():
                    if first_byte_ms is None:
                        first_byte_ms = (time.perf_counter() - started) * 1e3
                    yield chunk
            except httpx.HTTPError as e:
                # the status line is gone already: all that is left is to end the body
                logger.warning("decode server %s broke off its answer: %s", server, e)
            finally:
                with anyio.CancelScope(shield=True):  # also when the client went away
                    await upstream.aclose()
                if method == "POST":
                    logger.info(
                        "%s %s request %s: prefill %s %s %.1f ms, decode %s HTTP %d first "
                        "byte %s ms, total %.1f ms", method, path, request_id, prefill.outcome,
                        prefill.server, prefill.ms, server, upstream.status_code,
                        "-" if first_byte_ms is None else f"{first_byte_ms:.1f}",
                        (time.perf_counter() - started) * 1e3 + prefill.ms)

        headers_out = {PREFILL_HEADER: prefill.outcome, REQUEST_ID_HEADER: request_id}
        if "content-type" in upstream.headers:
            headers_out["content-type"] = upstream.headers["content-type"]
        if stream and upstream.is_success:
            return StreamingResponse(body(), status_code=upstream.status_code,
                                     headers=headers_out)
        content_out = b"".join([chunk async for chunk in body()])
        return Response(content_out, status_code=upstream.status_code, headers=headers_out)

    async def completion(request: Request) -> Response:
        path = request.url.path
        request_id = request.headers.get(REQUEST_ID_HEADER) or f"kvo-{uuid.uuid4().hex}"
        headers = backend_headers(request, request_id)
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return await proxied(decode_servers.next(), path, "POST", raw, headers,
                                 _Prefill("skipped"), request_id, stream=False)
        prefill = await run_prefill(path, body, path.endswith("/chat/completions"), headers)
        content = json.dumps(decode_request_body(body, prefill.params)).encode()
        return await proxied(decode_servers.next(), path, "POST", content, headers,
                             prefill, request_id, stream=body.get("stream") is True)

    async def passthrough(request: Request) -> Response:
        request_id = request.headers.get(REQUEST_ID_HEADER) or f"kvo-{uuid.uuid4().hex}"
        headers = backend_headers(request, request_id)
        headers.pop("content-type")
        return await proxied(decode_servers.next(), request.url.path, "GET", None,
                             headers, _Prefill("skipped"), request_id, stream=False)

    routes = [*(Route(p, completion, methods=["POST"]) for p in COMPLETION_PATHS),
              *(Route(p, passthrough, methods=["GET"]) for p in PASSTHROUGH_PATHS)]
    return Starlette(routes=routes, lifespan=lifespan)


def build_server(settings: ProxySettings, host: str, port: int) -> Any:
    """A uvicorn server of the proxy, not started (`.run()` blocks; tests run it in a thread
    and stop it with `should_exit`). Logging is left to the caller's configuration (the
    command line sets it), and uvicorn's access log is off: the proxy logs each request
    itself, with its timings."""
    uvicorn = _require_server_side()
    config = uvicorn.Config(create_app(settings), host=host, port=port, log_config=None,
                            access_log=False, lifespan="on")
    return uvicorn.Server(config)
