"""Two vLLM CPU engine processes, one shared store: a prompt computed by the first engine is
served to the second from the shared tier, with the outputs of recompute.

The engines have different host tiers (64 MiB and 32 MiB) and share only the store: a real
redis-server on loopback (the Valkey tier), or moto's S3 server on loopback (the S3 tier,
whose requests run in its helper process, started from vLLM's worker process). The second
engine starts with an empty host tier, so every token it reports as cached came through the
shared tier; its outputs match, bit for bit, an engine without the connector whose own
prefix cache served the same prefixes. The engines share a `secret_file`, as a shared tier
requires (its records are authenticated).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from engine_harness import run_engine, token_ids
from test_connector import PROMPTS, cached, full_prefixes, outputs, spec

from kv_offload.backends.valkey.local_server import BINARIES, server_binary

from helpers.servers import new_secret_file

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def valkey_url():
    if importlib.util.find_spec("redis") is None:
        pytest.skip("redis-py is not installed (pip install -e '.[dev]')")
    if server_binary() is None:
        pytest.skip(f"no Valkey/Redis server binary ({' or '.join(BINARIES)}) on PATH; the "
                    f"README's test command installs Debian's redis-server")
    from kv_offload.backends.valkey.local_server import LocalServer

    with LocalServer(maxmemory="256mb") as server:
        yield server.url


@pytest.fixture(scope="module")
def s3_bucket():
    """(endpoint, bucket) on moto's S3 server on loopback; the credentials moto takes are in
    the environment, which the engine processes inherit."""
    pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[dev]')")
    pytest.importorskip("moto.server", reason="moto[server] is not installed "
                                              "(pip install -e '.[dev]')")
    import boto3

    from kv_offload.backends.s3.local_server import TEST_CREDENTIALS, LocalS3Server

    with pytest.MonkeyPatch.context() as mp, LocalS3Server() as server:
        for name, value in TEST_CREDENTIALS.items():
            mp.setenv(name, value)
        boto3.client("s3", endpoint_url=server.endpoint_url).create_bucket(Bucket="e2e")
        yield server.endpoint_url, "e2e"


@pytest.fixture(scope="module")
def shared_secret(tmp_path_factory) -> str:
    """The secret_file every engine of this module's shared stores is started with."""
    return new_secret_file(tmp_path_factory.mktemp("secret"))


@pytest.fixture(scope="module")
def baseline(tiny_models, tmp_path_factory):
    """Without the connector: computed, then served by vLLM's own prefix cache (a prefix from
    any cache is continued by a short prefill, which may round differently in the last bits
    than one long prefill: a hit is compared like for like, tokens with both)."""
    return run_engine(spec(tiny_models["llama"], [{}, {}]),
                      tmp_path_factory.mktemp("baseline"))


def shared_config(tier: str, options: dict, cpu_bytes: str, secret_file: str) -> dict:
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kv_offload.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": cpu_bytes, "storage_tier": tier, "storage_options": options,
            "secret_file": secret_file},
    }


def test_a_second_engine_is_served_from_the_shared_valkey_tier(tiny_models, tmp_path,
                                                                valkey_url, baseline,
                                                                shared_secret):
    import redis

    options = {"url": valkey_url, "key_prefix": f"e2e-{os.getpid()}:"}
    check_served_through(tiny_models["llama"], tmp_path, baseline, "valkey", options,
                         shared_secret,
                         lambda: redis.Redis.from_url(valkey_url).keys(f"e2e-{os.getpid()}:*"))


def test_a_second_engine_is_served_from_the_shared_s3_tier(tiny_models, tmp_path, s3_bucket,
                                                            baseline, shared_secret):
    import boto3

    endpoint, bucket = s3_bucket
    options = {"bucket": bucket, "endpoint_url": endpoint,
               "bytes_to_use": "256MiB"}  # (helper_process: the default)
    s3 = boto3.client("s3", endpoint_url=endpoint)
    check_served_through(tiny_models["llama"], tmp_path, baseline, "s3", options, shared_secret,
                         lambda: s3.list_objects_v2(Bucket=bucket).get("Contents", []))


def check_served_through(model, tmp_path, baseline, tier: str, options: dict, secret: str,
                         stored) -> None:
    first = run_engine(spec(model, [{}], shared_config(tier, options, "64MiB", secret)),
                       tmp_path / "first")
    assert stored(), "the first engine wrote nothing to the server"
    second = run_engine(spec(model, [{}], shared_config(tier, options, "32MiB", secret)),
                        tmp_path / "second")
    (cold,), (served,) = first["passes"], second["passes"]
    computed, engine_cached = baseline["passes"]
    assert cached(cold) == [0] * len(PROMPTS)
    assert outputs(cold) == outputs(computed)
    assert cached(served) == full_prefixes(served) == cached(engine_cached)  # through the store
    assert outputs(served) == outputs(engine_cached)  # tokens and top-5 logprobs, bit for bit
    assert token_ids(served) == token_ids(computed)
    assert "will be recomputed" not in (tmp_path / "second" / "engine.log").read_text()
