"""Real servers on loopback for the shared-store tiers: Valkey/Redis and S3 (moto).

The Valkey/Redis server is Debian's ``redis-server`` (or a ``valkey-server``) installed by the
README's test command; the S3 endpoint is moto's server from the ``dev`` extra. Each runs in
a child process on a free 127.0.0.1 port. Session-wide servers serve tests that only need a
server (each test uses its own key prefix or bucket); tests that kill, restart or pause a
server get their own. Helpers that are not fixtures (`unique_name`, `make_bucket`,
`shared_tier_options`) are in tests/helpers/servers.py.
"""

from __future__ import annotations

import pytest


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


@pytest.fixture
def workers():
    """Worker sides a test appends here are shut down after it (their threads stop)."""
    started: list = []
    yield started
    for worker in started:
        worker.shutdown()
