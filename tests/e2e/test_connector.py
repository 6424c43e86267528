"""KVOffloadConnector inside the real vLLM 0.32 CPU engine, loaded the way users load it
(`kv_transfer_config` with `kv_connector_module_path`), no patch to vLLM.

Every claim is checked against a run of the same engine without the connector: greedy
tokens, and the top-5 logprobs of every generated position, must be bit-identical whether
the KV came from recomputation, from our host tier or from our disk tier in a new process;
a corrupted disk tier must be recomputed. (Random-weight models decode repetitively, so the
logprobs, not only the argmax, are what a wrong byte of KV would show up in.)
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from engine_harness import cacheable_prefix, run_engine, token_ids

from kv_offload.testing.tiny_vocab import word_prompt

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
LOGPROBS = 5
# Longer than gemma3's 64-token window, not multiples of the 32-token engine block.
PROMPTS = [word_prompt(150), word_prompt(70, offset=200), word_prompt(260, offset=400)]
MODELS = ["llama", "gemma3"]


def connector_config(fs_root: Path | None, cpu_bytes: str = "64MiB") -> dict[str, Any]:
    extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes}
    if fs_root is not None:
        extra.update(storage_tier="filesystem",
                     storage_options={"root_dir": str(fs_root), "bytes_to_use": "256MiB"})
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kv_offload.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def spec(model_dir: Path, passes: list[dict], kv_transfer_config: dict | None = None,
         batch: bool = False, **extra: Any) -> dict[str, Any]:
    """An engine run. Unless `batch`, each pass sends its prompts one at a time: bf16
    logprobs depend on which requests share a step, and a request whose prefix is loaded
    joins the batch whenever its load ends (as with vLLM's own connectors), so exact
    comparisons run one request per step."""
    if not batch:
        passes = [{"one_at_a_time": True, **p} for p in passes]
    engine_args: dict[str, Any] = {}
    if kv_transfer_config is not None:
        engine_args["kv_transfer_config"] = kv_transfer_config
    engine_args.update(extra.pop("engine_args", {}))
    return {"model": str(model_dir), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "logprobs": LOGPROBS,
            "passes": passes, "engine_args": engine_args, **extra}


def outputs(pass_result: dict[str, Any]) -> list[tuple[list[int], list[dict]]]:
    """Per request: generated tokens and the top logprobs at each position (exact floats)."""
    return [(r["token_ids"], r["logprobs"]) for r in pass_result["requests"]]


def cached(pass_result: dict[str, Any]) -> list[int]:
    return [r["num_cached_tokens"] for r in pass_result["requests"]]


def full_prefixes(pass_result: dict[str, Any]) -> list[int]:
    return [cacheable_prefix(r["prompt_len"]) for r in pass_result["requests"]]


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Per model: a run without the connector, and a connector run (cold pass, then a pass
    after vLLM's own prefix cache was reset) writing through to a disk directory."""
    out: dict[str, dict[str, Any]] = {}
    for model in MODELS:
        work = tmp_path_factory.mktemp(f"connector_{model}")
        fs_root = work / "kv"
        # Without the connector: computed, then served by vLLM's own prefix cache (a prefix
        # from any cache is continued by a short prefill, which may round differently in
        # the last bits than one long prefill: hits are compared like for like).
        baseline = run_engine(spec(tiny_models[model], [{}, {}]), work / "baseline")
        offload = run_engine(
            spec(tiny_models[model], [{}, {"reset_prefix_cache": True}],
                 connector_config(fs_root), metrics_prefix="vllm:kv_offload",
                 engine_args={"disable_log_stats": False}),
            work / "offload")
        out[model] = {"baseline": baseline, "offload": offload, "fs_root": fs_root,
                      "work": work}
    return out


@pytest.mark.parametrize("model", MODELS)
def test_outputs_identical_with_connector(runs, model):
    computed, engine_cached = runs[model]["baseline"]["passes"]
    cold, from_host = runs[model]["offload"]["passes"]
    assert cached(cold) == [0] * len(PROMPTS)
    assert cached(engine_cached) == cached(from_host) == full_prefixes(from_host)
    assert outputs(cold) == outputs(computed)
    assert outputs(from_host) == outputs(engine_cached)
    assert token_ids(from_host) == token_ids(computed)


@pytest.mark.parametrize("model", MODELS)
def test_reset_engine_cache_is_served_from_host_tier(runs, model):
    """vLLM's own cache is empty after the reset: every cached token came from our tier,
    and the hit covers the whole cacheable prefix (all but the last partial block)."""
    _, from_host = runs[model]["offload"]["passes"]
    assert cached(from_host) == full_prefixes(from_host)


@pytest.mark.parametrize("model", MODELS)
def test_connector_metrics_reach_vllm_prometheus(runs, model):
    metrics = runs[model]["offload"]["metrics"]
    by_name: dict[str, float] = {}
    for metric in metrics:
        by_name[metric["name"]] = by_name.get(metric["name"], 0.0) + metric["value"]
    _, from_host = runs[model]["offload"]["passes"]
    assert by_name["vllm:kv_offload_hit_tokens"] == sum(cached(from_host))
    assert by_name["vllm:kv_offload_loaded_bytes"] > 0
    assert by_name["vllm:kv_offload_stored_bytes"] > 0


@pytest.mark.parametrize("model", MODELS)
def test_each_ranks_start_up_line_reaches_the_engines_log_in_vllms_format(runs, model):
    """Our INFO lines went nowhere: vLLM gives only its own logger a handler."""
    log = (runs[model]["work"] / "offload" / "engine.log").read_text()
    lines = [line for line in log.splitlines() if "kv-offload rank 0: host tier" in line]
    assert len(lines) == 1, log[-3000:]
    [line] = lines  # vLLM's format: level, date, [file:line], then ours
    assert re.match(r"^(\(\w+ pid=\d+\) )?INFO \d\d-\d\d [\d:]+ \[offload_worker\.py:\d+\] "
                    r"kv-offload rank 0: host tier", line), line
    assert "storage tier: filesystem" in line and "records unauthenticated" in line
    assert "; weights identified by content" in line  # (one line says all a rank set up)


@pytest.mark.parametrize("model", MODELS)
def test_new_process_is_served_from_disk(runs, tiny_models, model):
    work = runs[model]["work"]
    assert any(runs[model]["fs_root"].rglob("*.safetensors"))
    fresh = run_engine(spec(tiny_models[model], [{}], connector_config(runs[model]["fs_root"])),
                       work / "from_disk")
    (first,) = fresh["passes"]
    assert cached(first) == full_prefixes(first)
    computed, engine_cached = runs[model]["baseline"]["passes"]
    assert outputs(first) == outputs(engine_cached)
    assert token_ids(first) == token_ids(computed)


@pytest.mark.parametrize("model", MODELS)
def test_corrupted_disk_files_are_recomputed(runs, tiny_models, model):
    """Flip bytes inside the data of every stored file: each read fails its checksum (a
    load's, or the start-up read probe's), nothing is served, outputs stay identical and the
    engine keeps running."""
    work = runs[model]["work"]
    corrupt_root = work / "kv_corrupt"
    shutil.copytree(runs[model]["fs_root"], corrupt_root)
    files = sorted(corrupt_root.rglob("*.safetensors"))
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF  # last bytes are page data, not the header
        path.write_bytes(bytes(data))
    result = run_engine(spec(tiny_models[model], [{}, {}], connector_config(corrupt_root)),
                        work / "corrupt")
    first, second = result["passes"]
    baseline = token_ids(runs[model]["baseline"]["passes"][0])
    assert token_ids(first) == baseline
    assert token_ids(second) == baseline
    assert cached(first) == [0] * len(PROMPTS)  # nothing usable was served
    # The bad files were refused: by a load (its request recomputes those blocks) or, at
    # start-up, by the read probe (kv_offload.store.probe: then the blocks are misses).
    log = (work / "corrupt" / "engine.log").read_text()
    assert "will be recomputed" in log or "refused and removed" in log


def test_tensor_parallel_2_host_tier(tiny_models, tmp_path):
    """TP=2 (two worker processes, each with its own shard and pool): after the engine cache
    reset, both ranks serve the whole prefix: the tokens match the cold pass, tokens and
    logprobs match a pass served by vLLM's own cache. (TP=2 is compared with itself: its
    all-reduce rounds differently from TP=1 in bf16.)"""
    result = run_engine(
        spec(tiny_models["llama"], [{}, {}, {"reset_prefix_cache": True}],
             connector_config(None), engine_args={"tensor_parallel_size": 2}),
        tmp_path / "tp2", multiprocess=True,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, timeout_s=600)
    cold, engine_cached, from_host = result["passes"]  # (the 2nd: vLLM's own cache)
    assert cached(cold) == [0] * len(PROMPTS)
    assert cached(from_host) == cached(engine_cached) == full_prefixes(from_host)
    assert outputs(from_host) == outputs(engine_cached)  # like for like
    assert token_ids(from_host) == token_ids(cold)


def test_preemption_under_memory_pressure_keeps_outputs_identical(tiny_models, tmp_path):
    """A KV cache too small for the batch makes vLLM preempt and re-admit requests (and
    free sliding-window blocks) while our stores and loads are in flight: the tokens must
    still match a run without the connector under the same pressure."""
    prompts = [word_prompt(200, offset=50 * i) for i in range(8)]
    pressure = {"kv_cache_memory_bytes": 1024 * 1024, "max_model_len": 512,
                "disable_log_stats": False}
    common = {"prompts": prompts, "max_tokens": 48, "metrics_prefix": "vllm:num_preemptions"}
    baseline = run_engine({**spec(tiny_models["gemma3"], [{}], batch=True,
                                  engine_args=pressure), **common}, tmp_path / "baseline")
    result = run_engine(
        {**spec(tiny_models["gemma3"], [{}, {"reset_prefix_cache": True}],
                connector_config(None), batch=True, engine_args=pressure), **common},
        tmp_path / "offload")
    preemptions = sum(m["value"] for m in result["metrics"])
    assert preemptions > 0, "the test lost its point: vLLM did not preempt"
    cold, again = result["passes"]
    assert token_ids(cold) == token_ids(baseline["passes"][0])
    assert token_ids(again) == token_ids(baseline["passes"][0])
