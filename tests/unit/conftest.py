"""Real servers on loopback for the shared-store tiers: Valkey/Redis and S3 (moto).

The Valkey/Redis server is Debian's ``redis-server`` (or a ``valkey-server``) installed by the
README's test command; the S3 endpoint is moto's server from the ``dev`` extra. Each runs in
a child process on a free 127.0.0.1 port. Session-wide servers serve tests that only need a
server (each test uses its own key prefix or bucket); tests that kill, restart or pause a
server get their own.
"""

from __future__ import annotations

import itertools
import os

import pytest

_names = itertools.count()


def unique_name(stem: str) -> str:
    """A bucket or key prefix no other test in this session uses."""
    return f"{stem}-{os.getpid()}-{next(_names)}"


def _local_valkey(**kw):
    from kv_offload.backends.valkey.local_server import BINARIES, server_binary

    if server_binary() is None:
        pytest.skip(f"no Valkey/Redis server binary ({' or '.join(BINARIES)}) on PATH; the "
                    f"README's test command installs Debian's redis-server")
    from kv_offload.backends.valkey.local_server import LocalServer

    return LocalServer(**kw)


@pytest.fixture(scope="session")
def valkey_server():
    """One server for the session (256 MB, allkeys-lru)."""
    pytest.importorskip("redis", reason="redis-py is not installed (pip install -e '.[dev]')")
    server = _local_valkey(maxmemory="256mb")
    yield server
    server.stop()


@pytest.fixture
def own_valkey_server():
    """A server of this test alone (8 MB, allkeys-lru), to kill, restart or pause."""
    pytest.importorskip("redis", reason="redis-py is not installed (pip install -e '.[dev]')")
    server = _local_valkey(maxmemory="8mb")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_credentials():
    """moto accepts any credentials; boto3 reads these from the environment."""
    from kv_offload.backends.s3.local_server import TEST_CREDENTIALS

    with pytest.MonkeyPatch.context() as mp:
        for name, value in TEST_CREDENTIALS.items():
            mp.setenv(name, value)
        yield


def _local_s3():
    pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[dev]')")
    pytest.importorskip("moto.server", reason="moto[server] is not installed "
                                              "(pip install -e '.[dev]')")
    from kv_offload.backends.s3.local_server import LocalS3Server

    return LocalS3Server()


@pytest.fixture(scope="session")
def s3_server(s3_credentials):
    server = _local_s3()
    yield server
    server.stop()


@pytest.fixture
def own_s3_server(s3_credentials):
    server = _local_s3()
    yield server
    server.stop()


def make_bucket(endpoint_url: str) -> str:
    import boto3

    name = unique_name("kv-test")
    boto3.client("s3", endpoint_url=endpoint_url).create_bucket(Bucket=name)
    return name


def shared_tier_options(backend: str, request: pytest.FixtureRequest, stem: str) -> dict:
    """`storage_options` of a fresh namespace on this session's loopback server of
    `backend` ("valkey": a key prefix; "s3": a new bucket), background listing off."""
    if backend == "valkey":
        pytest.importorskip("redis")
        server = request.getfixturevalue("valkey_server")
        return {"url": server.url, "key_prefix": unique_name(stem) + ":",
                "refresh_interval_s": 0}
    pytest.importorskip("boto3")
    server = request.getfixturevalue("s3_server")
    return {"bucket": make_bucket(server.endpoint_url), "bytes_to_use": "64MiB",
            "endpoint_url": server.endpoint_url, "refresh_interval_s": 0}


@pytest.fixture
def workers():
    """Worker sides a test appends here are shut down after it (their threads stop)."""
    started: list = []
    yield started
    for worker in started:
        worker.shutdown()
