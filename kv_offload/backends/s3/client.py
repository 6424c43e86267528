"""The boto3 client of the S3 tier: bounded waits, no second checksum, cheap timestamps.

Contents:
- `make_client(config)`: an S3 client with the tier's timeouts, retries and connection pool.
- `parse_timestamp`: the timestamp parser its responses use.
- `read_body(reply, limit)`: at most ``limit`` bytes of a GET reply's body, the body closed
  after, a failure raised as botocore's error (see its docstring for why not a with-block).
- `endpoint_cache_advice(version)`: what to say of a botocore that resolves the endpoint
  per object key (before 1.43.14: every request evaluates S3's whole endpoint rule set, 5
  to 27% of its CPU here, by how it was measured; boto/botocore#3692). The `s3` extra
  requires a newer one; a botocore installed apart from it gets one warning per process.
  (It is the helper process's CPU by default: remote_client.py.)

Why a parser of our own: a listing page holds 1000 ``LastModified`` timestamps, and
botocore's default parser (dateutil) took ~60% of the CPU of a page (62 ms of CPU per 1000
objects against moto here, 23 ms with this one). ISO 8601, what listings send, is parsed by
``datetime.fromisoformat`` (C); any other form (an HTTP date in a header) goes to botocore's
own parser, so every timestamp is still a ``datetime``.
"""

from __future__ import annotations

import logging
from datetime import datetime

import boto3
import botocore
import botocore.session
from botocore.config import Config as BotoConfig
from botocore.utils import parse_timestamp as botocore_timestamp

from kv_offload.backends.s3.config import S3TierConfig

logger = logging.getLogger(__name__)

FIXED_IN = (1, 43, 14)  # the first botocore whose S3 endpoint cache is per bucket
_advised = False


def endpoint_cache_advice(version: str) -> str | None:
    """A warning for a botocore older than `FIXED_IN`, else None."""
    try:
        parts = tuple(int(p) for p in version.split(".")[:3])
    except ValueError:  # (a development build: nothing to say)
        return None
    if parts >= FIXED_IN:
        return None
    return (f"kv-offload S3 tier: botocore {version} resolves the S3 endpoint again for "
            f"every object key (fixed in botocore 1.43.14, boto/botocore#3692), which costs "
            f"the engine's process CPU on every request; install kv-offload[s3] or "
            f"`pip install 'boto3>=1.43.14'`")


def parse_timestamp(value: str) -> datetime:
    try:
        return datetime.fromisoformat(value)  # (Python 3.11+: accepts the trailing "Z")
    except (TypeError, ValueError):
        return botocore_timestamp(value)


def read_body(reply: dict, limit: int) -> bytes:
    """At most ``limit`` bytes of a ``get_object`` reply's body; the body is closed after
    (what is unread past ``limit`` never comes: the connection is dropped, not drained).

    Not ``with reply["Body"] as stream``: botocore's ``StreamingBody.__enter__`` returns the
    raw urllib3 response, whose failures are urllib3's own exceptions (``ReadTimeoutError``,
    ``ProtocolError``: neither an ``OSError`` nor a ``BotoCoreError``), so a body that
    stalls past the request deadline looked like a bug (a traceback, no outage) instead of
    the endpoint's trouble. ``StreamingBody.read`` raises botocore's ``ReadTimeoutError`` /
    ``ResponseStreamingError`` for them, which callers handle like any other timeout."""
    body = reply["Body"]
    try:
        return body.read(limit)
    finally:
        body.close()


def make_client(config: S3TierConfig):
    """A client of its own session (the parser setting stays with it)."""
    global _advised
    if not _advised and (advice := endpoint_cache_advice(botocore.__version__)):
        logger.warning(advice)
    _advised = True
    session = botocore.session.get_session()
    session.get_component("response_parser_factory").set_parser_defaults(
        timestamp_parser=parse_timestamp)
    style = config.addressing_style or ("path" if config.endpoint_url else "auto")
    return boto3.session.Session(botocore_session=session).client(
        "s3", endpoint_url=config.endpoint_url, region_name=config.region_name,
        config=BotoConfig(
            connect_timeout=config.connect_timeout_s, read_timeout=config.timeout_s,
            retries={"max_attempts": config.max_attempts, "mode": "standard"},
            max_pool_connections=config.connections + 2, s3={"addressing_style": style},
            # Our records carry their own xxh3 checksum: no second one per request.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required"))
