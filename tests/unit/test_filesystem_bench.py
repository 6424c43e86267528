"""The filesystem benchmark runs end to end and reports what the CLI expects (not timed)."""

from __future__ import annotations

import json
import os

from kv_offload.tools import bench_filesystem as bench


def test_bench_reports_throughputs_ratios_and_zero_mismatches(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench.run_filesystem_bench(
        str(tmp_path / "root"), 64 * 1024, 8, str(out), io_threads=2, repeats=1
    )
    assert json.loads(out.read_text()) == result
    for field in ("write_gbps", "read_gbps", "baseline_write_gbps", "baseline_read_gbps",
                  "write_ratio", "read_ratio"):
        assert result[field] > 0, field
    assert result["mismatches"] == 0 and result["failed_keys"] == 0
    assert os.listdir(tmp_path / "root") == []  # it cleans up after itself
    assert "mismatches: 0" in capsys.readouterr().out


def test_cli_bench_filesystem(tmp_path):
    from kv_offload.tools.cli import main

    out = tmp_path / "fs.json"
    status = main(["bench", "--backend", "filesystem", "--fs-root", str(tmp_path / "root"),
                   "--chunks", "4", "--page-kib", "64", "--json", str(out)])
    result = json.loads(out.read_text())
    assert status == 0 and result["mismatches"] == 0 and result["read_ratio"] > 0
