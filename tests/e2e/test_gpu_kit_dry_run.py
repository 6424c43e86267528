"""The GPU kit's dry run (issue 49): benchmarks/gpu/run_on_gpu.py on vLLM's CPU build.

The GPU machine is lent for minutes and has no network, so its script must not meet a bug
there that a CPU could show. This runs the script as the GPU machine will (its own step
processes, engine processes and time bounds), with `--device cpu --tiny`, and reads the
results JSON it writes: tokens from our host tier (after `reset_prefix_cache()`) and from
our disk tier (a new engine process) are the cold tokens and every hit is full; the
side-by-side step times every source, and vLLM's native OffloadingConnector either ran or
is recorded as skipped with vLLM's reason (its CPU build refuses it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_harness import cacheable_prefix

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu" / "run_on_gpu.py"
PROMPT_TOKENS = 512


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("gpu_kit_dry_run")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in [str(REPO), os.environ.get("PYTHONPATH")] if p)}
    # (correctness is `kv-offload demo` itself, whose CPU run tests/e2e/test_demo.py checks
    # on the same code: not run twice in CI, which must stay under 30 minutes)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny",
                           "--steps", "preflight,side_by_side",
                           "--prompt-tokens", str(PROMPT_TOKENS), "--out", str(out)],
                          cwd=out, env=env, capture_output=True, text=True, timeout=600)
    log = (out / "run.log").read_text() if (out / "run.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:] + log[-4000:]
    return json.loads((out / "results.json").read_text()), out


def test_every_dry_run_step_passes_on_the_cpu_platform(dry_run):
    results, out = dry_run
    assert results["device"] == "cpu" and results["tiny"] is True
    assert {k: v["status"] for k, v in results["steps"].items()} == {
        "preflight": "passed", "side_by_side": "passed"}
    preflight = results["steps"]["preflight"]["result"]
    assert preflight["platform"] == "CpuPlatform"
    assert preflight["kernels"]["module"] == "vllm._C"
    assert preflight["kernels"]["registered_C_ops"] > 0
    for step in results["steps"].values():
        assert 0 < step["wall_s"] <= step["bound_s"]
    assert "===== step side_by_side" in (out / "run.log").read_text()


def test_side_by_side_times_every_source_and_records_the_native_connector(dry_run):
    side = dry_run[0]["steps"]["side_by_side"]["result"]
    assert side["problems"] == []
    ttft = side["ttft"]
    full = cacheable_prefix(PROMPT_TOKENS)
    assert ttft["recompute"]["cached_tokens"] == [0, 0]
    for source, label in (("vllm_hit", "device"), ("ours_host", "host"),
                          ("ours_disk", "disk")):
        assert ttft[source]["cached_tokens"] == [full], source
        assert ttft[source]["hits_by_source"] == [{label: full}], source
        assert ttft[source]["median_s"] > 0 and ttft[source]["x_recompute"] > 0
    native = side["engines"]["native"]
    if native["status"] == "skipped":  # vLLM's CPU build: its reason, in its own words
        assert "only supported on CUDA" in native["reason"]
        assert "native_cpu" not in ttft
    else:
        assert native["status"] == "ran" and ttft["native_cpu"]["cached_tokens"] == [full]
