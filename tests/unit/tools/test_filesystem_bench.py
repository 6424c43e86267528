"""`kv-offload bench --tier filesystem`: the tier against raw disk I/O, end to end at tiny
sizes (not timed), and the raw baseline really moves the bytes it is credited with."""

from __future__ import annotations

import json
import os

import torch

from kv_offload.tools.bench_filesystem import RAW, raw_disk
from kv_offload.tools.bench_tiers import RawCell, _pool
from kv_offload.tools.cli import main

FIGURES = {"store_gbps", "load_gbps", "baseline_store_gbps", "baseline_load_gbps",
           "store_ratio", "load_ratio", "mismatches", "failed_keys"}


def test_bench_reports_the_tier_against_the_raw_disk_with_zero_mismatches(tmp_path, capsys):
    out, root = tmp_path / "fs.json", tmp_path / "root"
    status = main(["bench", "--tier", "filesystem", "--fs-root", str(root),
                   "--page-kib", "64", "128", "--total-mib", "1", "--connections", "1", "2",
                   "--batch-mib", "0.25", "--repeats", "2", "--json", str(out)])
    document = json.loads(out.read_text())
    result = document["results"]
    assert status == 0 and document["command"] == "bench" and document["statistic"] == "best"
    assert set(result) >= FIGURES and result["tier"] == "filesystem"
    assert all(result[f] > 0 for f in FIGURES - {"mismatches", "failed_keys"})
    assert result["mismatches"] == 0 and result["failed_keys"] == 0
    cells = {(c["tier"], c["value_mib"], c["connections"]): c for c in result["cells"]}
    assert set(cells) == {(t, s, c) for t in ("filesystem", RAW) for s in (0.0625, 0.125)
                          for c in (1, 2)}
    # --batch-mib 0.25: four 64 KiB values, two 128 KiB values per job
    assert cells[("filesystem", 0.0625, 1)]["values_per_job"] == 4
    assert cells[("filesystem", 0.125, 2)]["values_per_job"] == 2
    assert all(len(c["samples"]["store_gbps"]) == 2 for c in cells.values())
    assert os.listdir(root) == []  # it cleans up after itself
    assert "mismatches: 0" in capsys.readouterr().out


def test_the_raw_baseline_writes_and_reads_back_the_same_bytes(tmp_path):
    size, count = 64 * 1024, 8
    source, target = _pool(size * count, seed=1), _pool(size * count)
    store_gbps, load_gbps = raw_disk(RawCell(size, 1, count, source, target, str(tmp_path)))
    assert store_gbps > 0 and load_gbps > 0
    assert torch.equal(source, target)
    assert (tmp_path / "raw.bin").stat().st_size == size * count


def test_record_modes_measure_each_mode_in_the_same_run_with_every_byte_checked(tmp_path):
    out, root = tmp_path / "fs.json", tmp_path / "root"
    status = main(["bench", "--tier", "filesystem", "--fs-root", str(root),
                   "--page-kib", "64", "--total-mib", "1", "--connections", "2",
                   "--repeats", "1", "--record-modes", "plain", "auth", "encrypt",
                   "--json", str(out)])
    result = json.loads(out.read_text())["results"]
    assert status == 0 and result["mismatches"] == 0 and result["failed_keys"] == 0
    tiers = {c["tier"]: c for c in result["cells"]}
    assert set(tiers) == {"filesystem", "filesystem+auth", "filesystem+encrypt", RAW}
    assert all(c["store_gbps"] > 0 and c["load_gbps"] > 0 for c in tiers.values())


def test_record_modes_do_not_apply_to_the_host_tier(capsys):
    assert main(["bench", "--tier", "host", "--record-modes", "auth"]) == 2
    assert "--record-modes does not apply to --tier host" in capsys.readouterr().err
