"""`kv-offload proxy`: the command line of `kv_offload.serving.pd_proxy`.

Unlike the measuring subcommands it prints no table and writes no JSON: it serves until
interrupted, and logs one line per request on stderr. Its flags are checked before anything
listens (a URL without http(s)://, a port out of range, a timeout of zero: exit 2 with
argparse's usage); missing starlette/uvicorn/httpx exit 2 naming the extra that brings them.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kv_offload.errors import ProxyDependencyError, ServingError
from kv_offload.serving.client import api_roots

DESCRIPTION = """\
Serve the OpenAI completions API in front of vLLM servers split into prefill and decode
servers, all running kv-offload over a shared storage tier. Each request to
/v1/completions or /v1/chat/completions goes first to a prefill server (asked for one token,
so that it computes and stores the prompt's KV cache), then to a decode server, which loads
that KV cache and generates the answer; streamed answers are passed on as they arrive.
Servers of each kind are used in turn. GET /v1/models and /health go to a decode server.

If a prefill server fails, the decode server computes the prompt itself (the response says
x-kv-offload-prefill: failed); if a decode server cannot be reached, the client gets 502.
Every response says x-kv-offload-prefill: ok, failed or skipped. One log line per request
on stderr gives the prefill time and the decode server's time to its first byte."""


def _server_url(text: str) -> str:
    try:
        return api_roots(text)[0]
    except ServingError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 1 to 65535, got {text!r}")
    return port


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"a positive number of seconds, got {text!r}")
    return seconds


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", required=True, type=_server_url,
                        metavar="URL",
                        help="a prefill server, e.g. http://10.0.0.1:8100 (repeat the flag "
                             "for several: they are used in turn)")
    parser.add_argument("--decode", action="append", required=True, type=_server_url,
                        metavar="URL",
                        help="a decode server, e.g. http://10.0.0.2:8200 (repeat the flag "
                             "for several: they are used in turn)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; 0.0.0.0 for every "
                             "interface)")
    parser.add_argument("--port", type=_port, default=8000, metavar="PORT",
                        help="port to listen on (default 8000)")
    parser.add_argument("--timeout-s", type=_seconds, default=600.0, metavar="SECONDS",
                        help="seconds allowed for each request to a server (default 600: a "
                             "long prompt's prefill or a long answer takes minutes)")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"),
                        help="what to log on stderr (default info: one line per request)")
    parser.set_defaults(run=run_proxy)


def run_proxy(args: argparse.Namespace) -> int:
    from kv_offload.serving.pd_proxy import ProxySettings, build_server

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = ProxySettings.from_urls(args.prefill, args.decode, args.timeout_s)
    try:
        server = build_server(settings, args.host, args.port)
    except ProxyDependencyError as e:
        print(f"kv-offload proxy: {e}", file=sys.stderr)
        return 2
    server.run()
    # uvicorn exits with code 1 (and logs why) when it cannot listen, e.g. a port in use
    return 0 if server.started else 1
