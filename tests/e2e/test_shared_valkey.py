"""Two vLLM CPU engine processes, one Valkey/Redis server: a prompt computed by the first
engine is served to the second from the shared tier, with the outputs of recompute.

The engines have different host tiers (64 MiB and 32 MiB) and share only the server (a real
redis-server on loopback). The second engine starts with an empty host tier, so every token
it reports as cached came through the Valkey tier; its outputs match, bit for bit, an engine
without the connector whose own prefix cache served the same prefixes.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from engine_harness import run_engine, token_ids
from test_connector import PROMPTS, cached, full_prefixes, outputs, spec

from kv_offload.backends.valkey.local_server import BINARIES, server_binary

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


def shared_config(url: str, cpu_bytes: str) -> dict:
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kv_offload.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": cpu_bytes, "storage_tier": "valkey",
            "storage_options": {"url": url, "key_prefix": f"e2e-{os.getpid()}:"}},
    }


def test_a_second_engine_is_served_from_the_shared_valkey_tier(tiny_models, tmp_path,
                                                                valkey_url):
    import redis

    model = tiny_models["llama"]
    # Without the connector: computed, then served by vLLM's own prefix cache (a prefix from
    # any cache is continued by a short prefill, which may round differently in the last
    # bits than one long prefill: the hit is compared like for like, tokens with both).
    baseline = run_engine(spec(model, [{}, {}]), tmp_path / "baseline")
    first = run_engine(spec(model, [{}], shared_config(valkey_url, "64MiB")),
                       tmp_path / "first")
    stored = redis.Redis.from_url(valkey_url).keys(f"e2e-{os.getpid()}:*")
    assert stored, "the first engine wrote nothing to the server"
    second = run_engine(spec(model, [{}], shared_config(valkey_url, "32MiB")),
                        tmp_path / "second")
    (cold,), (served,) = first["passes"], second["passes"]
    computed, engine_cached = baseline["passes"]
    assert cached(cold) == [0] * len(PROMPTS)
    assert outputs(cold) == outputs(computed)
    assert cached(served) == full_prefixes(served) == cached(engine_cached)  # through Valkey
    assert outputs(served) == outputs(engine_cached)  # tokens and top-5 logprobs, bit for bit
    assert token_ids(served) == token_ids(computed)
    assert "will be recomputed" not in (tmp_path / "second" / "engine.log").read_text()
