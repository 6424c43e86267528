"""`kv-offload bench --tier valkey|s3` runs end to end (tiny sizes, real servers), reports
what the other tiers report, and its byte check catches a tier that serves wrong bytes.
(Not timed: throughput is the benchmark's business, not a test's.)"""

from __future__ import annotations

import json

import pytest
import torch

from kv_offload.backends.example import DictTier
from kv_offload.tools.bench_stores import filesystem_factory
from kv_offload.tools.bench_tiers import BenchPlan, BenchTier, run_tier_bench
from kv_offload.tools.cli import main

FIELDS = {"store_gbps", "load_gbps", "baseline_store_gbps", "baseline_load_gbps",
          "store_ratio", "load_ratio", "mismatches", "failed_keys", "cells"}
CELL_FIELDS = {"tier", "value_mib", "connections", "store_gbps", "load_gbps", "lookup_p50_us",
               "lookup_p99_us", "load_p50_ms", "load_p99_ms", "mismatches", "failed_keys"}


@pytest.mark.parametrize("backend", ["valkey", "s3"])
def test_cli_bench_runs_every_cell_against_the_filesystem_tier(backend, request, tmp_path,
                                                                capsys):
    if backend == "valkey":
        pytest.importorskip("redis")
        extra = ["--url", request.getfixturevalue("valkey_server").url]
    else:
        pytest.importorskip("boto3")
        request.getfixturevalue("s3_credentials")  # the CLI starts its own moto server
        extra = []
    out = tmp_path / "bench.json"
    code = main(["bench", "--tier", backend, *extra, "--page-kib", "256", "1024",
                 "--connections", "1", "2", "--total-mib", "2", "--repeats", "2",
                 "--fs-root", str(tmp_path / "fs"), "--json", str(out)])
    result = json.loads(out.read_text())["results"]
    assert code == 0 and set(result) >= FIELDS and result["tier"] == backend
    assert result["mismatches"] == 0 and result["failed_keys"] == 0
    cells = result["cells"]
    assert {(c["tier"], c["value_mib"], c["connections"]) for c in cells} == {
        (tier, size, conns) for tier in (backend, "filesystem") for size in (0.25, 1)
        for conns in (1, 2)}
    assert all(set(c) >= CELL_FIELDS and c["store_gbps"] > 0 and c["load_gbps"] > 0
               and len(c["samples"]["load_gbps"]) == 2 for c in cells)
    assert ("goal" in result) == (backend == "valkey")
    table = capsys.readouterr().out
    assert "filesystem" in table and backend in table and "mismatches: 0" in table


def test_cli_bench_runs_against_a_loopback_cluster_with_redis_benchmark_beside_it(tmp_path):
    pytest.importorskip("redis")
    from kv_offload.backends.valkey.local_cluster import cli_binary
    from kv_offload.tools.bench_valkey_server import benchmark_binary

    if cli_binary() is None or benchmark_binary() is None:
        pytest.skip("no redis-cli / redis-benchmark on PATH (apt-get install -y redis-server)")
    out = tmp_path / "bench.json"
    code = main(["bench", "--tier", "valkey", "--cluster", "3", "--page-kib", "256",
                 "--connections", "2", "--total-mib", "2", "--repeats", "1",
                 "--fs-root", str(tmp_path / "fs"), "--json", str(out)])
    result = json.loads(out.read_text())["results"]
    assert code == 0 and result["mismatches"] == 0 and result["failed_keys"] == 0
    tiers = {c["tier"] for c in result["cells"]}
    assert {"valkey", "filesystem"} <= tiers and any("benchmark" in t for t in tiers)
    assert all(c["store_gbps"] > 0 and c["load_gbps"] > 0 for c in result["cells"])


class _FlipsAByteOnRead(DictTier):
    """A real tier that serves one wrong byte per read."""

    def _load(self, key: bytes, buf: torch.Tensor) -> bool:
        ok = super()._load(key, buf)
        buf.view(torch.uint8)[7] ^= 1
        return ok


def test_the_byte_check_counts_wrong_bytes(tmp_path):
    plan = BenchPlan(page_bytes=(64 * 1024,), connections=(1,), total_bytes=1 << 20,
                     values_per_job=lambda size: 4, repeats=1, work_root=str(tmp_path))
    result = run_tier_bench("dict", {
        "dict": BenchTier(lambda conns, workdir: _FlipsAByteOnRead()),
        "filesystem": BenchTier(filesystem_factory)}, plan,
                            baseline="filesystem", baseline_note="the filesystem tier")
    by_tier = {c["tier"]: c for c in result["cells"]}
    assert by_tier["dict"]["mismatches"] == 16 and by_tier["filesystem"]["mismatches"] == 0
    assert result["mismatches"] == 16


@pytest.mark.parametrize("backend", ["filesystem", "valkey"])
def test_cli_bench_compression_reports_bytes_stored_with_and_without_in_one_run(
        backend, request, tmp_path, capsys):
    pytest.importorskip("blosc2")
    extra = []
    if backend == "valkey":
        pytest.importorskip("redis")
        extra = ["--url", request.getfixturevalue("valkey_server").url]
    out = tmp_path / "bench.json"
    code = main(["bench", "--tier", backend, *extra, "--compression", "lossless",
                 "--page-kib", "256", "--connections", "2", "--total-mib", "2",
                 "--repeats", "1", "--fs-root", str(tmp_path / "fs"), "--json", str(out)])
    result = json.loads(out.read_text())["results"]
    assert code == 0 and result["mismatches"] == 0 and result["failed_keys"] == 0
    cells = {c["tier"]: c for c in result["cells"]}
    plain, packed = cells[backend], cells[f"{backend}+lossless"]
    assert plain["page_bytes_written"] == packed["page_bytes_written"] == 2 << 20
    assert packed["record_bytes_written"] < 0.85 * plain["record_bytes_written"]
    assert packed["store_gbps"] > 0 and packed["load_gbps"] > 0
    assert "stored/page" in capsys.readouterr().out


def test_compression_does_not_apply_to_the_host_tier(capsys):
    assert main(["bench", "--tier", "host", "--compression", "lossless"]) == 2
    assert "--compression does not apply to --tier host" in capsys.readouterr().err
