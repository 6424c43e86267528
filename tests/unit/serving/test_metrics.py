"""`kv_offload.serving.metrics`: what a client reads from a vLLM server's `/metrics`.

The expositions are written by prometheus_client itself, with the names and labels vLLM and
`KVOffloadPromMetrics` use (the end-to-end serving tests read a real server's).
"""

from __future__ import annotations

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from kv_offload.serving.metrics import OffloadCounters, parse_metrics  # noqa: E402


def exposition(*, with_connector: bool = True, engines: int = 2,
               vllms_own_offloading: bool = False) -> str:
    registry = prometheus_client.CollectorRegistry()

    def counter(name: str, *extra: str) -> prometheus_client.Counter:
        return prometheus_client.Counter(name, "doc", ["engine", "model_name", *extra],
                                         registry=registry)

    info = prometheus_client.Gauge("vllm:cache_config_info", "doc",
                                   ["engine", "block_size", "enable_prefix_caching"],
                                   registry=registry)
    local, external = counter("vllm:prefix_cache_hits"), counter(
        "vllm:external_prefix_cache_hits")
    if with_connector:
        hits = counter("vllm:kv_offload_hit_tokens", "tier")
        queries = counter("vllm:kv_offload_query_tokens")
        loaded = counter("vllm:kv_offload_loaded_bytes")
        stored = counter("vllm:kv_offload_stored_bytes")
        failed = counter("vllm:kv_offload_failed_blocks", "direction")
        faults = counter("vllm:kv_offload_faults", "side")
        used = prometheus_client.Gauge("vllm:kv_offload_tier_bytes_used", "doc",
                                       ["engine", "model_name", "tier"], registry=registry)
    if vllms_own_offloading:  # (vLLM's OffloadingConnector: the same prefix, other names)
        theirs = counter("vllm:kv_offload_load_bytes")
    for e in range(engines):
        engine = (str(e), "m")
        info.labels(str(e), "64", "True").set(1)
        local.labels(*engine).inc(100 * (e + 1))
        external.labels(*engine).inc(10 * (e + 1))
        if with_connector:
            hits.labels(*engine, "host").inc(64 * (e + 1))
            hits.labels(*engine, "disk").inc(128 * (e + 1))
            queries.labels(*engine).inc(1000 * (e + 1))
            loaded.labels(*engine).inc(4096 * (e + 1))
            stored.labels(*engine).inc(8192 * (e + 1))
            failed.labels(*engine, "load").inc(1 * (e + 1))
            failed.labels(*engine, "store").inc(2 * (e + 1))
            used.labels(*engine, "host").set(12345)
            faults.labels(*engine, "worker").inc(0)
        if vllms_own_offloading:
            theirs.labels(*engine).inc(4096)
    return prometheus_client.generate_latest(registry).decode()


def test_connector_counters_are_summed_over_engines_and_split_by_tier_and_direction():
    metrics = parse_metrics(exposition())
    assert metrics.offload == OffloadCounters(
        hit_tokens_host=64 + 128, hit_tokens_storage=128 + 256, query_tokens=3000,
        loaded_bytes=3 * 4096, stored_bytes=3 * 8192, failed_load_blocks=3,
        failed_store_blocks=6)
    assert metrics.offload.hit_tokens == 192 + 384
    assert metrics.storage_tier == "disk"  # (the storage tier's label on the hit counter)
    assert (metrics.local_hit_tokens, metrics.external_hit_tokens) == (300, 30)


def test_a_server_without_the_connector_has_no_offload_counters():
    metrics = parse_metrics(exposition(with_connector=False))
    assert metrics.offload is None
    assert metrics.local_hit_tokens == 300


def test_vllms_own_offloading_connector_is_not_taken_for_ours():
    metrics = parse_metrics(exposition(with_connector=False, vllms_own_offloading=True))
    assert metrics.offload is None


def test_block_size_and_prefix_caching_come_from_vllms_cache_config_info():
    metrics = parse_metrics(exposition(engines=1))
    assert (metrics.block_size, metrics.prefix_caching) == (64, True)
    bare = parse_metrics("")
    assert (bare.block_size, bare.prefix_caching, bare.offload) == (None, None, None)


def test_counter_deltas_subtract_field_by_field():
    later = OffloadCounters(hit_tokens_host=10, hit_tokens_storage=7, query_tokens=50,
                            loaded_bytes=400, stored_bytes=900, failed_load_blocks=2)
    earlier = OffloadCounters(hit_tokens_host=4, hit_tokens_storage=7, query_tokens=20,
                              loaded_bytes=100, stored_bytes=900)
    assert later.since(earlier) == OffloadCounters(
        hit_tokens_host=6, hit_tokens_storage=0, query_tokens=30, loaded_bytes=300,
        stored_bytes=0, failed_load_blocks=2)
