"""The `kv-offload` command line as a user runs it: a real subprocess per run, at tiny sizes.

Every subcommand writes the same JSON envelope, every bench tier reports the same figure
names, a flag a tier cannot honour is refused (exit 2, the flag named, nothing measured),
and a planted bad tier (wrong bytes, failed keys) makes the exit status 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kv_offload
from kv_offload.tools.report import Table

REPO = Path(kv_offload.__file__).resolve().parent.parent
ENVELOPE = {"command", "version", "statistic", "results"}
FIGURES = {"store_gbps", "load_gbps", "baseline_store_gbps", "baseline_load_gbps",
           "store_ratio", "load_ratio", "mismatches", "failed_keys"}

# Planted tiers: real DictTiers that serve a wrong byte, or report every read failed (with
# the right bytes copied: only the failure report can make the exit status 1).
PLANTED = '''
import torch
from kv_offload.backends.example import DictTier


class FlipsAByte(DictTier):
    def _load(self, key, buf):
        ok = super()._load(key, buf)
        buf.view(torch.uint8)[11] ^= 0xFF
        return ok


class FailsReads(DictTier):
    def _load(self, key, buf):
        super()._load(key, buf)
        return False
'''


def kv_offload_cli(*args: str, cwd: Path, extra_path: Path | None = None,
                   timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m kv_offload.tools.cli ARGS` with this checkout's kv_offload first on the path."""
    path = [str(REPO), *([str(extra_path)] if extra_path else []),
            os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    return subprocess.run([sys.executable, "-m", "kv_offload.tools.cli", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def stdout_envelope(proc: subprocess.CompletedProcess) -> dict:
    """`--json -`: stdout must be exactly one JSON document (tables and progress elsewhere)."""
    document = json.loads(proc.stdout)
    assert set(document) == ENVELOPE, document.keys()
    assert document["version"] == kv_offload_version() == kv_offload.__version__
    return document


def kv_offload_version() -> str:
    from kv_offload.tools.report import version

    return version()


BENCH_RUNS = {
    "host": ["--tier", "host", "--page-kib", "4", "--batch-mib", "1"],
    "filesystem": ["--tier", "filesystem", "--page-kib", "64", "--total-mib", "0.5",
                   "--connections", "1"],
    "module:Class": ["--tier", "kv_offload.backends.example:DictTier", "--page-kib", "64",
                     "--total-mib", "0.5", "--tier-options", '{"max_bytes": 16777216}'],
}


@pytest.mark.parametrize("tier", sorted(BENCH_RUNS))
def test_every_bench_tier_writes_the_envelope_with_the_same_figures(tier, tmp_path):
    fs_root = [] if tier == "host" else ["--fs-root", str(tmp_path / "fs")]
    proc = kv_offload_cli("bench", *BENCH_RUNS[tier], *fs_root, "--repeats", "2",
                          "--seed", "7", "--json", "-", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    document = stdout_envelope(proc)
    result = document["results"]
    assert document["command"] == "bench" and document["statistic"] == "best"
    assert set(result) >= FIGURES
    assert result["mismatches"] == 0 and result["failed_keys"] == 0
    assert all(result[f] > 0 for f in FIGURES - {"mismatches", "failed_keys"})
    assert result["repeats"] == 2 and result["seed"] == 7
    assert "mismatches: 0" in proc.stderr  # the table moved to stderr
    assert "(2/2)" in proc.stderr  # progress, also on stderr


def test_bench_table_goes_to_stdout_when_json_goes_to_a_file(tmp_path):
    out = tmp_path / "bench.json"
    proc = kv_offload_cli("bench", *BENCH_RUNS["host"], "--repeats", "1", "--json", str(out),
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "store" in proc.stdout and "baseline GB/s" in proc.stdout
    assert "repeat 1 (1/1)" in proc.stderr and "repeat" not in proc.stdout
    assert set(json.loads(out.read_text())) == ENVELOPE


@pytest.mark.parametrize("args, message", [
    (["--tier", "host", "--fs-root", "/tmp/x"],
     "--fs-root does not apply to --tier host"),
    (["--tier", "host", "--connections", "2"],
     "--connections does not apply to --tier host"),
    (["--tier", "host", "--total-mib", "8"], "--total-mib does not apply to --tier host"),
    (["--tier", "host", "--page-kib", "4", "8"], "--tier host takes one --page-kib"),
    (["--tier", "host", "--layers", "3"], "--layers shapes the synthetic model"),
    (["--tier", "host", "--model", "gemma3", "--page-kib", "4"],
     "--model and --page-kib both choose the model"),
    (["--tier", "filesystem", "--layout", "BLNHC"],
     "--layout does not apply to --tier filesystem"),
    (["--tier", "filesystem", "--url", "redis://x"],
     "--url does not apply to --tier filesystem"),
    (["--tier", "valkey", "--bucket", "b"], "--bucket does not apply to --tier valkey"),
    (["--tier", "valkey", "--cluster", "3", "--url", "redis://x:1/0"],
     "--cluster starts a loopback cluster; --url names a server"),
    (["--tier", "valkey", "--cluster", "0"], "--cluster must be positive"),
    (["--tier", "s3", "--cluster", "3"], "--cluster does not apply to --tier s3"),
    (["--tier", "s3", "--bucket", "b"], "--bucket names a bucket of --endpoint-url"),
    (["--tier", "kv_offload.backends.example:DictTier", "--connections", "2"],
     "--connections does not apply to --tier kv_offload.backends.example:DictTier"),
    (["--tier", "kv_offload.backends.example:DictTier", "--tier-options", "[1]"],
     "--tier-options must be a JSON object"),
    (["--tier", "kv_offload.backends.example:DictTier", "--tier-options", '{"nope": 1}'],
     "nope"),
    (["--tier", "nosuch"], "--tier 'nosuch': expected one of host, filesystem"),
    (["--tier", "host", "--backend", "cpu"], "--backend is the old name of --tier"),
    (["--repeats", "0"], "--repeats must be positive, got 0"),
    (["--tier", "filesystem", "--page-kib", "0"], "--page-kib must be positive"),
])
def test_a_flag_a_tier_cannot_honour_is_refused_with_exit_2(args, message, tmp_path):
    proc = kv_offload_cli("bench", *args, "--json", "-", cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert message in proc.stderr
    assert proc.stdout == ""  # nothing measured, nothing written


def test_the_old_spellings_backend_and_cpu_still_run_with_a_note_naming_the_new_ones(tmp_path):
    proc = kv_offload_cli("bench", "--backend", "cpu", "--page-kib", "4", "--batch-mib", "1",
                          "--repeats", "1", "--json", "-", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "--backend is now --tier" in proc.stderr
    assert "the 'cpu' tier is now 'host'" in proc.stderr
    assert stdout_envelope(proc)["results"]["tier"] == "host"


@pytest.mark.parametrize("args, message", [
    (["inspect", "--num-blocks", "0"], "argument --num-blocks: must be >= 1, got 0"),
    (["demo", "--prompts", "0"], "argument --prompts: must be >= 1, got 0"),
    (["demo", "--max-tokens", "many"], "argument --max-tokens: expected a whole number"),
])  # (serve-check checks its own counts: test_serve_check_inputs.py)
def test_a_count_of_zero_or_less_is_refused_with_exit_2_before_anything_runs(args, message,
                                                                            tmp_path):
    proc = kv_offload_cli(*args, "--json", "-", cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert message in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("tier, figure", [("FlipsAByte", "mismatches"),
                                          ("FailsReads", "failed_keys")])
def test_a_planted_bad_tier_makes_bench_exit_1(tier, figure, tmp_path):
    (tmp_path / "planted_tiers.py").write_text(PLANTED)
    proc = kv_offload_cli("bench", "--tier", f"planted_tiers:{tier}", "--page-kib", "64",
                          "--total-mib", "0.25", "--repeats", "1", "--fs-root",
                          str(tmp_path / "fs"), "--json", "-", cwd=tmp_path,
                          extra_path=tmp_path)
    assert proc.returncode == 1, proc.stderr
    result = stdout_envelope(proc)["results"]
    assert result[figure] > 0
    if figure == "failed_keys":
        assert result["mismatches"] == 0  # the failure report alone gives the exit status
    cells = {c["tier"]: c for c in result["cells"]}
    assert cells["filesystem"]["mismatches"] == cells["filesystem"]["failed_keys"] == 0
    assert cells[f"planted_tiers:{tier}"][figure] > 0


def test_inspect_writes_the_envelope(tmp_path):
    proc = kv_offload_cli("inspect", "--model", "gemma3", "--model", "qwen3-next", "--json",
                          "-", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    document = stdout_envelope(proc)
    assert document["command"] == "inspect" and document["statistic"] is None
    assert [r["model"] for r in document["results"]] == ["gemma3", "qwen3-next"]
    assert "SlidingWindowSpec" in proc.stderr


def test_serve_check_of_a_dead_server_writes_the_envelope_and_exits_1(tmp_path):
    pytest.importorskip("openai")
    from kv_offload.serving.server import free_loopback_port

    url = f"http://127.0.0.1:{free_loopback_port()}"
    proc = kv_offload_cli("serve-check", url, "--timeout-s", "5", "--json", "-", cwd=tmp_path)
    assert proc.returncode == 1
    document = stdout_envelope(proc)
    assert document["command"] == "serve-check" and document["results"]["passed"] is False
    assert "FAILED" in proc.stderr


def test_the_table_aligns_columns_and_refuses_a_row_of_the_wrong_width():
    table = Table("title", ("name", "GB/s"))
    table.add("store", 1.5)
    table.add("baseline", 12.25)
    table.notes.append("mismatches: 0")
    assert table.render().splitlines() == [
        "title", "name       GB/s", "--------  -----", "store      1.50", "baseline  12.25",
        "mismatches: 0"]
    with pytest.raises(ValueError, match="has 1 cells"):
        table.add("lonely")
