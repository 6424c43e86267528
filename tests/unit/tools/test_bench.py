"""`kv-offload bench --tier host`: runs end to end (tiny sizes), writes the JSON
fields, and its byte check really catches misplaced bytes."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from kv_offload.store.host import HostTier
from kv_offload.tools import bench, bench_cpu
from kv_offload.tools.cli import main

FIELDS = {"store_gbps", "load_gbps", "baseline_store_gbps", "baseline_load_gbps",
          "store_ratio", "load_ratio", "store_ratio_median", "load_ratio_median",
          "mismatches", "failed_keys", "page_bytes", "blocks"}


@pytest.mark.parametrize("extra, page_bytes", [
    (["--page-kib", "4"], 4096),
    (["--page-kib", "2", "--layers", "3", "--pattern", "scattered", "--layout", "BLHNC"], 2048),
    (["--model", "gemma3"], 16 * 8 * 512 * 2),
])
def test_bench_runs_and_writes_json(tmp_path, capsys, extra, page_bytes):
    out = tmp_path / "bench.json"
    code = main(["bench", "--tier", "host", *extra, "--batch-mib", "1", "--repeats", "2",
                 "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())["results"]
    assert set(result) >= FIELDS
    assert result["mismatches"] == 0 and result["page_bytes"] == page_bytes
    assert result["blocks"] >= 4 and result["store_gbps"] > 0 and result["load_gbps"] > 0
    assert result["store_ratio"] == pytest.approx(result["store_gbps"]
                                                  / result["baseline_store_gbps"])
    assert result["store_gbps"] == max(result["samples"]["store_gbps"])  # the best of 2
    assert len(result["samples"]["load_gbps"]) == 2
    samples = result["samples"]  # the median of two repeats' own ratios is their mean
    assert result["load_ratio_median"] == pytest.approx(
        (samples["load_gbps"][0] / samples["baseline_load_gbps"][0]
         + samples["load_gbps"][1] / samples["baseline_load_gbps"][1]) / 2)
    table = capsys.readouterr().out
    assert "store" in table and "load" in table and "baseline" in table


class _MisreportingBackend(HostTier):
    """A real backend whose row lookup is off by one row: the bytes it points
    the check at are the wrong ones."""

    def pool_rows(self, slots):
        return (super().pool_rows(slots) + 1) % self.num_slots


def test_byte_check_counts_misplaced_bytes():
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    args = parser.parse_args(["--page-kib", "4", "--batch-mib", "1"])
    model, canonical, per_group = bench_cpu.build_model(args)
    bench_cpu.fill_pattern(model.buffer)
    rng = np.random.default_rng(0)
    blocks = rng.permutation(model.num_blocks)[:per_group]
    stores = {0: (blocks, np.arange(per_group))}
    loads = {0: (rng.permutation(model.num_blocks)[:per_group], np.arange(per_group))}
    failed = bench_cpu.FailedBlocks()
    with HostTier(canonical, per_group * canonical.slot_bytes_per_block(0)) as good:
        assert bench_cpu._verify(good, canonical, model, stores, loads, failed) == 0
    bench_cpu.fill_pattern(model.buffer)
    with _MisreportingBackend(canonical, per_group * canonical.slot_bytes_per_block(0)) as bad:
        assert bench_cpu._verify(bad, canonical, model, stores, loads, failed) > 0
    assert failed.count == 0


def test_bad_synthetic_sizes_are_refused():
    with pytest.raises(ValueError, match="must be positive"):
        bench_cpu.synthetic_model(0, 1, 4, "LBNHC")
