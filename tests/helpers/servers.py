"""What tests of the shared-store tiers need besides the loopback servers (those are the
fixtures of tests/unit/conftest.py): unique bucket names and key prefixes, a fresh bucket, the
`storage_options` of a fresh namespace, and a `secret_file` (a shared tier starts only with one,
or with `trusted_store: true`)."""

from __future__ import annotations

import itertools
import os

import pytest

_names = itertools.count()


def unique_name(stem: str) -> str:
    """A bucket or key prefix no other test in this session uses."""
    return f"{stem}-{os.getpid()}-{next(_names)}"


def new_secret_file(directory: os.PathLike | str) -> str:
    """A fresh secret file in `directory`, made as `kv-offload secret new` makes it."""
    from kv_offload.tools.secret_cmd import write_new_secret

    path = os.path.join(directory, unique_name("secret"))
    write_new_secret(path)
    return path


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
