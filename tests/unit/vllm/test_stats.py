"""Connector metrics: merging across ranks and steps, the log summary, transport, Prometheus."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
    KVConnectorStats,
)

from kv_offload.vllm.stats import (  # noqa: E402
    COUNTERS,
    KVOffloadPromMetrics,
    KVOffloadStats,
    build_prom_metrics,
    build_stats,
)

GIB = 1 << 30


def worker_stats(rank: int, load_bytes: int, host_used: int) -> KVOffloadStats:
    stats = KVOffloadStats()
    stats.record_load(blocks=4, nbytes=load_bytes, seconds=0.25, failed_blocks=rank)
    stats.record_store(blocks=2, nbytes=1000, seconds=0.5, failed_blocks=rank // 2,
                       skipped_blocks=3)
    stats.set_usage("host", host_used, 8 * GIB, rank=rank)
    stats.set_usage("disk", 0, 0, rank=rank)
    stats.record_faults(worker=rank + 1)
    stats.record_storage_failures(read_keys=rank, write_keys=1, rejected_records=rank)
    stats.record_storage_writes(page_bytes=4096 * rank, record_bytes=3000 * rank)
    return stats


def scheduler_stats() -> KVOffloadStats:
    stats = KVOffloadStats()
    stats.record_lookup(query_tokens=700, hit_tokens=192, tier="host")
    stats.record_lookup(query_tokens=300, hit_tokens=64, tier="disk")
    stats.record_lookup(query_tokens=600, hit_tokens=0)
    stats.record_faults(scheduler=1)
    stats.record_waits({"remote_promised_blocks": 7, "remote_foreign": 1, "remote_waits": 2,
                        "remote_wait_seconds": 0.25, "remote_deadlines_missed": 1,
                        "find_waits": 3, "find_wait_seconds": 0.01,
                        "find_deadlines_missed": 1})
    return stats


def test_ranks_and_scheduler_merge_like_vllm():
    rank0, rank1 = worker_stats(0, 10_000, GIB), worker_stats(1, 30_000, 2 * GIB)
    sched = scheduler_stats()
    rank0_before = dict(rank0.data)
    # KVOutputAggregator folds worker ranks, then the scheduler merges its own stats.
    merged = rank0.aggregate(rank1).aggregate(sched)
    assert rank0.data == rank0_before  # aggregate returns a new object
    assert merged.count("load_jobs") == 2 and merged.count("load_blocks") == 8
    assert merged.count("load_bytes") == 40_000 and merged.count("load_seconds") == 0.5
    assert merged.count("load_failed_blocks") == 1 and merged.count("load_failed_jobs") == 1
    assert merged.count("store_jobs") == 2 and merged.count("store_skipped_blocks") == 6
    assert merged.count("lookups") == 3 and merged.count("query_tokens") == 1600
    assert (merged.count("hit_tokens"), merged.count("hit_tokens", "host"),
            merged.count("hit_tokens", "disk")) == (256, 192, 64)
    # Each rank owns a pool: the usage gauges add up over ranks.
    assert merged.usage("bytes_used", "host") == 3 * GIB
    assert merged.usage("bytes_total", "host") == 16 * GIB
    assert merged.usage("bytes_used", "disk") == 0
    assert sched.usage("bytes_used", "host") is None
    assert merged.tiers() == ["host", "disk"]


def test_successive_steps_keep_the_latest_gauge_per_rank():
    first, second = KVOffloadStats(), KVOffloadStats()
    first.set_usage("host", 100, 1000, rank=0)
    first.set_usage("valkey", 5, 50, servers_down=1, rank=0)
    first.set_usage("host", 200, 1000, rank=1)
    second.set_usage("host", 300, 1000, rank=0)
    second.set_usage("valkey", 7, 50, rank=0)
    merged = first.aggregate(second)
    assert merged.usage("bytes_used", "host") == 500  # rank 0 latest (300) + rank 1 (200)
    assert merged.usage("bytes_used", "valkey") == 7
    assert merged.usage("servers_down", "valkey") == 0  # the server answers again
    assert merged.usage("bytes_total", "host") == 2000


def test_empty_payloads_merge():
    empty = build_stats({}).aggregate(build_stats(None))
    assert empty.is_empty() and empty.data == {}
    sched = scheduler_stats()
    assert build_stats({}).aggregate(sched).data == sched.data
    assert sched.aggregate(KVOffloadStats()).data == sched.data


def test_is_empty_and_reset():
    stats = KVOffloadStats()
    assert stats.is_empty()
    stats.set_usage("host", 0, 0)
    assert not stats.is_empty()  # a gauge set to 0 is still a report
    stats.reset()
    assert stats.is_empty()
    stats.record_lookup(0, 0)
    assert not stats.is_empty() and stats.count("lookups") == 1
    stats.reset()
    stats.record_store(blocks=0, nbytes=0, seconds=0.0)
    assert stats.count("store_jobs") == 1


def test_reduce_from_known_inputs():
    stats = KVOffloadStats()
    stats.record_lookup(800, 200, "host")
    stats.record_lookup(200, 50, "disk")
    stats.record_load(blocks=10, nbytes=2_000_000_000, seconds=0.5, failed_blocks=2)
    stats.record_store(blocks=1, nbytes=123, seconds=0.0, failed_blocks=1, skipped_blocks=4)
    stats.set_usage("host", 3 * GIB, 8 * GIB, rank=0)
    stats.set_usage("disk", 0, 0, rank=0)
    stats.record_faults(scheduler=1, worker=2)
    stats.record_storage_failures(read_keys=3, write_keys=4)
    summary = stats.reduce()
    assert summary == {
        "Lookups": 2,
        "Hit rate (%)": 25.0,
        "Hit tokens": 250,
        "Load GB/s": 4.0,
        "Store GB/s": 0.0,  # no measured time: no rate
        "Failed blocks (load/store)": 3,
        "Skipped store blocks": 4,
        "Faults contained": 3,
        "Storage failed keys (read/write)": 7,
        "Disk hit tokens": 50,
        "Host used (GiB)": 3.0,  # no disk budget: no disk entry
    }
    stats.set_usage("host", GIB, 2 * GIB, rank=1)
    stats.set_usage("disk", GIB // 2, 4 * GIB, rank=1)
    summary = stats.reduce()
    assert summary["Host used (GiB)"] == 4.0 and summary["Disk used (GiB)"] == 0.5


def test_the_log_line_names_the_storage_tier_and_its_servers_down():
    stats = KVOffloadStats()
    stats.record_lookup(100, 64, "valkey")
    stats.set_usage("valkey", GIB, 2 * GIB, servers_down=2, rank=0)
    summary = build_stats(stats.to_dict()).reduce()  # (as the front end sees it)
    assert summary["Valkey hit tokens"] == 64
    assert summary["Valkey used (GiB)"] == 1.0
    assert summary["Valkey servers down"] == 2
    assert not any(k.startswith("Disk") for k in summary)
    assert KVOffloadStats().reduce()["Hit rate (%)"] == 0.0


def test_bad_input_names_the_offender():
    stats = KVOffloadStats()
    with pytest.raises(TypeError, match="KVConnectorStats"):
        stats.aggregate(KVConnectorStats(data={"lookups": 1}))
    with pytest.raises(ValueError, match="'bogus'"):
        build_stats({"bogus": 1})
    with pytest.raises(ValueError, match="'bytes_used:host@x'"):
        build_stats({"bytes_used:host@x": 1})
    with pytest.raises(ValueError, match="'bytes_used@0'"):
        build_stats({"bytes_used@0": 1})
    with pytest.raises(ValueError, match="'lookups:host'"):
        build_stats({"lookups:host": 1})
    with pytest.raises(ValueError, match="need their tier"):
        stats.record_lookup(10, 5)
    with pytest.raises(ValueError, match="tier label"):
        stats.set_usage("a@b", 1, 2)
    with pytest.raises(TypeError, match="'lookups'.*str"):
        build_stats({"lookups": "3"})
    with pytest.raises(TypeError, match="'lookups'.*bool"):
        build_stats({"lookups": True})
    with pytest.raises(ValueError, match="nbytes"):
        stats.record_load(blocks=1, nbytes=-5, seconds=0.1)
    with pytest.raises(ValueError, match="rank"):
        stats.set_usage("host", 1, 2, rank=-1)
    assert stats.is_empty()  # rejected calls changed nothing


def full_stats() -> KVOffloadStats:
    """Every counter moved, ints and floats, gauges of two ranks."""
    stats = worker_stats(1, 4096, GIB).aggregate(worker_stats(2, 1, 0)).aggregate(
        scheduler_stats())
    assert set(COUNTERS) <= set(stats.data)
    assert {type(v) for v in stats.data.values()} == {int, float}
    return stats


def test_pickle_round_trip():
    stats = full_stats()
    again = pickle.loads(pickle.dumps(stats))
    assert type(again) is KVOffloadStats and again == stats
    assert pickle.loads(pickle.dumps(stats.to_dict())) == stats.data


def test_payload_survives_vllm_msgpack_transport():
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    stats = full_stats()
    outputs = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict()))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    payload = decoded.scheduler_stats.kv_connector_stats
    assert payload == stats.data
    assert {k: type(v) for k, v in payload.items()} == {k: type(v) for k, v in stats.data.items()}
    assert build_stats(payload) == stats


class _ConnectorClassView:
    """What KVConnectorLogging reads from the connector class: its stats builder."""

    build_kv_connector_stats = staticmethod(build_stats)


def test_vllm_log_line_over_two_steps():
    logging = KVConnectorLogging(None)
    logging.connector_cls = _ConnectorClassView
    step1, step2 = KVOffloadStats(), KVOffloadStats()
    step1.record_lookup(100, 50, "host")
    step1.set_usage("host", GIB, 4 * GIB, rank=0)
    step2.record_lookup(100, 0)
    step2.set_usage("host", 2 * GIB, 4 * GIB, rank=0)
    logging.observe(step1.to_dict())
    logging.observe(step2.to_dict())
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1
    assert "Lookups=2" in lines[0] and "Hit rate (%)=25.0" in lines[0]
    assert "Host used (GiB)=2.0" in lines[0]  # the latest step, not the sum of steps
    logging.log(log_fn=lines.append)
    assert len(lines) == 1  # accumulator was reset: nothing more to log


def registry_metric_types(registry: CollectorRegistry) -> dict[type, type]:
    """prometheus_client classes that register into `registry` instead of the global one."""

    def bound(cls: type) -> type:
        return type(cls.__name__, (cls,), {
            "__init__": lambda self, *a, **kw: cls.__init__(self, *a, registry=registry, **kw)
        })

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def kv_vllm_config(**extra) -> VllmConfig:
    return VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="KVOffloadConnector", kv_connector_module_path="kv_offload.vllm",
        kv_role="kv_both", kv_connector_extra_config=extra))


def test_prometheus_counters_add_up_and_gauges_follow():
    registry = CollectorRegistry()
    metrics = build_prom_metrics(kv_vllm_config(storage_tier="filesystem"),
                                 registry_metric_types(registry),
                                 ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    assert isinstance(metrics, KVOffloadPromMetrics)

    def sample(name: str, engine: str = "0", **labels: str) -> float | None:
        return registry.get_sample_value(
            f"vllm:kv_offload_{name}", {"model_name": "m", "engine": engine, **labels})

    step = KVOffloadStats()
    assert sample("hit_tokens_total", tier="disk") == 0  # (the series exist from the start)
    step.record_lookup(700, 192, "host")
    step.record_lookup(300, 64, "disk")
    step.record_load(blocks=4, nbytes=4096, seconds=0.25, failed_blocks=1)
    step.record_store(blocks=2, nbytes=2048, seconds=0.5, failed_blocks=2, skipped_blocks=1)
    step.set_usage("host", 100, 1000, rank=0)
    step.set_usage("disk", 10, 500, rank=0)
    step.set_usage("host", 200, 1000, rank=1)
    step.set_usage("disk", 0, 500, rank=1)
    metrics.observe(step.to_dict(), engine_idx=0)
    later = KVOffloadStats()
    later.record_lookup(24, 24, "host")
    metrics.observe(later.to_dict(), engine_idx=0)

    assert sample("hit_tokens_total", tier="host") == 216
    assert sample("hit_tokens_total", tier="disk") == 64
    assert sample("query_tokens_total") == 1024
    assert sample("loaded_bytes_total") == 4096 and sample("stored_bytes_total") == 2048
    assert sample("load_seconds_total") == 0.25 and sample("store_seconds_total") == 0.5
    assert sample("failed_blocks_total", direction="load") == 1
    assert sample("failed_blocks_total", direction="store") == 2
    # Gauges: ranks summed; a step without usage leaves them as they were.
    assert sample("tier_bytes_used", tier="host") == 300
    assert sample("tier_bytes_total", tier="host") == 2000
    assert sample("tier_bytes_used", tier="disk") == 10
    assert sample("tier_bytes_total", tier="disk") == 1000
    # The other engine has its own children, untouched.
    assert sample("query_tokens_total", engine="1") == 0
    metrics.observe({}, engine_idx=1)
    assert sample("query_tokens_total", engine="1") == 0

    newer = KVOffloadStats()
    newer.set_usage("host", 50, 1000, rank=0)
    metrics.observe(newer.to_dict(), engine_idx=0)
    assert sample("tier_bytes_used", tier="host") == 50
    assert sample("query_tokens_total") == 1024


def test_a_valkey_tier_is_labelled_valkey_and_says_when_its_servers_are_down():
    registry = CollectorRegistry()
    metrics = build_prom_metrics(kv_vllm_config(storage_tier="valkey"),
                                 registry_metric_types(registry),
                                 ["model_name", "engine"], {0: ["m", "0"]})

    def sample(name: str, tier: str) -> float | None:
        return registry.get_sample_value(f"vllm:kv_offload_{name}",
                                         {"model_name": "m", "engine": "0", "tier": tier})

    assert sample("hit_tokens_total", "valkey") == 0
    assert sample("hit_tokens_total", "disk") is None  # (no disk tier on this server)
    step = KVOffloadStats()
    step.record_lookup(100, 64, "valkey")
    step.set_usage("valkey", 10, 100, servers_down=1, rank=0)
    metrics.observe(step.to_dict(), engine_idx=0)
    assert sample("hit_tokens_total", "valkey") == 64
    assert sample("tier_servers_down", "valkey") == 1
    back = KVOffloadStats()
    back.set_usage("valkey", 10, 100, servers_down=0, rank=0)
    metrics.observe(back.to_dict(), engine_idx=0)
    assert sample("tier_servers_down", "valkey") == 0
    # A plug-in tier: its class name, its series made when first seen.
    plug = KVOffloadStats()
    plug.record_lookup(10, 10, "MyTier")
    metrics.observe(plug.to_dict(), engine_idx=0)
    assert sample("hit_tokens_total", "MyTier") == 10


def test_each_tier_has_one_label():
    from kv_offload.backends import tier_label

    assert [tier_label(n) for n in ("filesystem", "valkey", "s3", "pkg.mod:MyTier")] == [
        "disk", "valkey", "s3", "MyTier"]


def test_rejected_records_reach_their_prometheus_counter():
    registry = CollectorRegistry()
    metrics = build_prom_metrics(kv_vllm_config(), registry_metric_types(registry),
                                 ["model_name", "engine"], {0: ["m", "0"]})
    step = KVOffloadStats()
    step.record_storage_failures(read_keys=3, write_keys=0, rejected_records=2)
    metrics.observe(step.to_dict(), engine_idx=0)
    metrics.observe(step.to_dict(), engine_idx=0)
    assert registry.get_sample_value("vllm:kv_offload_storage_rejected_records_total",
                                     {"model_name": "m", "engine": "0"}) == 4


def test_storage_bytes_written_before_and_after_compression_reach_prometheus():
    registry = CollectorRegistry()
    metrics = build_prom_metrics(kv_vllm_config(), registry_metric_types(registry),
                                 ["model_name", "engine"], {0: ["m", "0"]})
    step = KVOffloadStats()
    step.record_storage_writes(page_bytes=4096, record_bytes=3000)
    metrics.observe(step.to_dict(), engine_idx=0)
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:kv_offload_storage_page_bytes_written_total",
                                     labels) == 4096
    assert registry.get_sample_value("vllm:kv_offload_storage_record_bytes_written_total",
                                     labels) == 3000
