"""`kv-offload demo` end to end: the real CLI, real vLLM engine processes, the tiny model.

Baseline (no connector): every pass recomputes and gives the cold tokens. With the connector:
the pass after `reset_prefix_cache()` and the pass in a new engine process are served from
kv-offload's CPU and disk tiers and still give the cold tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_harness import cacheable_prefix

from kv_offload.tools.demo import _pass_results

NUM_PROMPTS, PROMPT_TOKENS, MAX_TOKENS = 2, 200, 3


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo_cache")  # the tiny model is built once for the module


def _run_demo(cache_dir: Path, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "demo.json"
    cmd = [sys.executable, "-m", "kv_offload.tools.cli", "demo", "--model-size", "tiny",
           "--repeats", "2",
           "--prompts", str(NUM_PROMPTS), "--prompt-tokens", str(PROMPT_TOKENS),
           "--max-tokens", str(MAX_TOKENS), "--cache-dir", str(cache_dir),
           "--work-dir", str(tmp_path / "work"), "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "same output" in proc.stdout  # the table was printed
    document = json.loads(out.read_text())
    assert document["command"] == "demo" and document["results"]["mismatches"] == 0
    return document["results"]


def _check_common(result: dict[str, Any]) -> None:
    assert [p["name"] for p in result["passes"]] == ["cold", "host", "disk"]
    assert [p["engine_process"] for p in result["passes"]] == [1, 1, 2]
    assert result["outputs_identical"] is True
    import vllm
    assert result["engine"] == {"vllm": vllm.__version__, "device": "cpu"}  # (this build's)
    cold = result["passes"][0]
    assert cold["cached_tokens"] == 0
    assert cold["speedup"] == pytest.approx(1.0)
    for p in result["passes"]:
        assert p["prompt_tokens"] == NUM_PROMPTS * PROMPT_TOKENS
        assert p["identical"] is True
        assert p["seconds"] > 0 and len(p["samples"]) == 2
        assert p["cached_tokens_min"] == p["cached_tokens"]
        assert len(p["requests"]) == NUM_PROMPTS
        assert all(len(r["token_ids"]) == MAX_TOKENS for r in p["requests"])
        assert [r["token_ids"] for r in p["requests"]] == [
            r["token_ids"] for r in cold["requests"]]


@pytest.mark.e2e
def test_demo_with_connector_serves_cpu_and_disk_passes(cache_dir, tmp_path):
    result = _run_demo(cache_dir, tmp_path)
    _check_common(result)
    config = result["kv_transfer_config"]
    assert config["kv_connector"] == "KVOffloadConnector"
    assert config["kv_load_failure_policy"] == "recompute"
    full_hit = NUM_PROMPTS * cacheable_prefix(PROMPT_TOKENS)
    assert [p["cached_tokens"] for p in result["passes"]] == [0, full_hit, full_hit]
    assert any((tmp_path / "work" / "disk").rglob("*")), "the disk tier wrote nothing"


@pytest.mark.e2e
def test_demo_serves_a_qwen3_next_like_hybrid_with_its_recurrent_state(cache_dir, tmp_path):
    """`--model qwen3-next`: GatedDeltaNet layers beside full attention; the recurrent
    state is stored and loaded with the attention blocks (vLLM's 64-token blocks here)."""
    result = _run_demo(cache_dir, tmp_path, "--model", "qwen3-next")
    _check_common(result)
    assert result["model"]["architecture"] == "qwen3-next"
    cached = [p["cached_tokens"] for p in result["passes"]]
    assert cached[0] == 0
    assert cached[1] == cached[2] == NUM_PROMPTS * cacheable_prefix(PROMPT_TOKENS, 64)


def test_pass_results_flag_outputs_that_differ_from_the_cold_pass():
    def pass_(name: str, tokens: list[int], seconds: float) -> dict[str, Any]:
        return {"name": name, "runs": [{"seconds": seconds, "requests": [
            {"prompt_len": 64, "num_cached_tokens": 32, "token_ids": tokens}]}]}

    results = _pass_results(
        [pass_("cold", [1, 2], 2.0), pass_("host", [1, 2], 0.5), pass_("disk", [1, 3], 1.0)],
        no_connector=False,
    )
    assert [r.identical for r in results] == [True, True, False]
    assert [r.speedup for r in results] == [1.0, 4.0, 2.0]
    assert [r.source for r in results] == ["recompute", "kv-offload host tier",
                                           "kv-offload disk tier"]
