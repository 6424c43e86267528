"""benchmarks/bench_s3_request_cpu.py at a tiny scale: every way runs against a real moto
server in each tree's child process, and the table and JSON hold one figure per way."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_s3_request_cpu  # noqa: E402


def test_two_trees_alternate_and_every_way_reports_the_cpu_of_its_requests(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    # A second tree: this checkout's kv_offload again (what --compare does with another
    # botocore beside it, without installing one).
    other = tmp_path / "tree"
    other.mkdir()
    (other / "kv_offload").symlink_to(ROOT / "kv_offload")
    trees = [str(ROOT), str(other)]
    assert bench_s3_request_cpu.main(["--compare", *trees, "--rounds", "2", "--requests", "6",
                                      "--batch", "4", "--block-kib", "2",
                                      "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["trees"] == trees
    for tree in trees:
        runs = result["rounds"][tree]
        assert len(runs) == 2
        for run in runs:
            assert set(run["cpu_ms"]) == set(bench_s3_request_cpu.WAYS)
            # Some CPU per request, far less than a second (a failed job raises instead);
            # the helper's is read in clock ticks (10 ms): a few requests may show none.
            assert all(0 < ms < 1000 for way, ms in run["cpu_ms"].items()
                       if not way.startswith("helper_")), run
            assert 0 <= run["cpu_ms"]["helper_write"] < 1000, run
    table = capsys.readouterr().out
    assert "client_put" in table and "x first" in table
