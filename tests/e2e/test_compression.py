"""`compression: "lossless"` on the real vLLM CPU engine: the disk tier and the Valkey tier
store at most 0.85x the bytes of the same run without it, a new engine process serves those
records with full hits and the outputs of recompute (tokens and top-5 logprobs, bit for bit,
as served by vLLM's own prefix cache), and a corrupted compressed record is never served.

The same prompts run through two engines, one with compression and one without, each with a
store of its own (a directory, a key prefix on one loopback redis-server); the bytes each
store holds are summed (file sizes, ``STRLEN``). Then a new engine process with an empty host
tier reads the compressed store.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest
from engine_harness import run_engine, token_ids
from test_connector import PROMPTS, cached, full_prefixes, outputs, spec

from kv_offload.backends.valkey.local_server import BINARIES, server_binary

pytestmark = pytest.mark.e2e
pytest.importorskip("blosc2", reason="pip install -e '.[compress]'")


def config(tier: str, options: dict, compression: str, cpu_bytes: str = "64MiB") -> dict:
    extra = {"cpu_bytes_to_use": cpu_bytes, "storage_tier": tier, "storage_options": options,
             "compression": compression}
    if tier == "valkey":
        extra["trusted_store"] = True  # (a loopback server of this test alone)
    return {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kv_offload.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


@pytest.fixture(scope="module")
def baseline(tiny_models, tmp_path_factory):
    """Without the connector: computed, then served by vLLM's own prefix cache."""
    return run_engine(spec(tiny_models["llama"], [{}, {}]), tmp_path_factory.mktemp("baseline"))


@pytest.fixture(scope="module")
def valkey_url():
    if importlib.util.find_spec("redis") is None:
        pytest.skip("redis-py is not installed (pip install -e '.[dev]')")
    if server_binary() is None:
        pytest.skip(f"no Valkey/Redis server binary ({' or '.join(BINARIES)}) on PATH")
    from kv_offload.backends.valkey.local_server import LocalServer

    with LocalServer(maxmemory="256mb") as server:
        yield server.url


def check_served(model, work, baseline, tier, options, compression) -> dict:
    """A new engine process over the store: full hits, outputs of the baseline."""
    fresh = run_engine(spec(model, [{}], config(tier, options, compression, "32MiB")), work)
    (served,) = fresh["passes"]
    computed, engine_cached = baseline["passes"]
    assert cached(served) == full_prefixes(served)  # every token through the storage tier
    assert outputs(served) == outputs(engine_cached)  # tokens and top-5 logprobs
    assert token_ids(served) == token_ids(computed)
    return fresh


def stored_bytes(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


def test_disk_tier_stores_fewer_bytes_and_a_new_process_is_served(tiny_models, tmp_path,
                                                                  baseline):
    model = tiny_models["llama"]
    roots = {c: tmp_path / f"kv-{c}" for c in ("off", "lossless")}
    for compression, root in roots.items():
        options = {"root_dir": str(root), "bytes_to_use": "256MiB"}
        (cold,) = run_engine(spec(model, [{}], config("filesystem", options, compression)),
                             tmp_path / f"write-{compression}")["passes"]
        assert outputs(cold) == outputs(baseline["passes"][0])
    plain, packed = stored_bytes(roots["off"]), stored_bytes(roots["lossless"])
    print(f"disk tier: {packed} bytes stored with compression, {plain} without "
          f"({packed / plain:.3f}x)")
    assert plain > 0 and packed <= 0.85 * plain, (packed, plain)
    # (a reader with compression off opens compressed records too: unit-tested over every
    # tier in tests/unit/backends/test_compression.py; one engine fewer in CI here)
    check_served(model, tmp_path / "read", baseline, "filesystem",
                 {"root_dir": str(roots["lossless"]), "bytes_to_use": "256MiB"}, "lossless")

    # A corrupted compressed record is never served: flip a payload byte of every file.
    corrupt = tmp_path / "kv-corrupt"
    shutil.copytree(roots["lossless"], corrupt)
    for path in corrupt.rglob("*.safetensors"):
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    result = run_engine(spec(model, [{}], config(
        "filesystem", {"root_dir": str(corrupt), "bytes_to_use": "256MiB"}, "lossless")),
        tmp_path / "corrupt")
    (first,) = result["passes"]
    assert token_ids(first) == token_ids(baseline["passes"][0])
    assert cached(first) == [0] * len(PROMPTS)  # nothing usable was served
    log = (tmp_path / "corrupt" / "engine.log").read_text()
    assert "will be recomputed" in log or "refused and removed" in log


def test_valkey_tier_stores_fewer_bytes_and_a_new_process_is_served(tiny_models, tmp_path,
                                                                    baseline, valkey_url):
    import redis

    model = tiny_models["llama"]
    client = redis.Redis.from_url(valkey_url)
    totals = {}
    for compression in ("off", "lossless"):
        prefix = f"e2e-{os.getpid()}-{compression}:"
        run_engine(spec(model, [{}], config("valkey", {"url": valkey_url, "key_prefix": prefix},
                                            compression)), tmp_path / f"write-{compression}")
        names = [n for n in client.scan_iter(match=f"{prefix}*") if b"generation" not in n]
        totals[compression] = sum(client.strlen(n) for n in names)
    print(f"valkey tier: {totals['lossless']} bytes stored with compression, "
          f"{totals['off']} without ({totals['lossless'] / totals['off']:.3f}x)")
    assert totals["off"] > 0 and totals["lossless"] <= 0.85 * totals["off"], totals
    check_served(model, tmp_path / "read", baseline, "valkey",
                 {"url": valkey_url, "key_prefix": f"e2e-{os.getpid()}-lossless:"}, "lossless")
