"""Mamba-type hybrids through KVOffloadConnector on the real vLLM 0.32 CPU engine.

Two tiny random-weight hybrids, built locally: Qwen3-Next-like (GatedDeltaNet layers and a
full-attention layer; vLLM defaults) and Granite-4-like (Mamba2 layers and a full-attention
layer; vLLM's CPU Mamba2 scan needs `max_num_batched_tokens == block_size` in prefix-caching
"align" mode). Each has three Mamba-type groups and one attention group, 64-token blocks.

Every claim is checked against the same engine without the connector (greedy tokens and the
top-5 logprobs at every generated position, exact floats). A random-weight model could ignore
its recurrent state, which would let a connector that never restores it pass; so each model
also runs a negative control (`no_state_restore.NoStateRestoreConnector`: same hits, same
attention loads, Mamba-type states not restored), whose outputs must differ.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from engine_harness import run_engine, token_ids

from kv_offload.testing.tiny_models import build_granite_hybrid, build_qwen3_next
from kv_offload.testing.tiny_vocab import word_prompt

pytestmark = pytest.mark.e2e

BLOCK = 64  # the unified block size vLLM picks for both tiny hybrids (checked below)
MAX_TOKENS = 8
LOGPROBS = 5
# Not multiples of the block, except the last (its final state sits exactly at a boundary).
PROMPTS = [word_prompt(150), word_prompt(70, offset=200), word_prompt(256, offset=300)]
# Each starts with a whole prompt above and goes on: a hit may cover at most the shared part.
LONGER = [PROMPTS[0] + " " + word_prompt(90, offset=420),
          PROMPTS[2] + " " + word_prompt(60, offset=20)]
# The SSM state in float32 on every machine: vLLM's CPU platform sets it so itself only where
# the CPU has AVX-512 BF16 (its accelerated GDN/Mamba path); elsewhere (AVX2) the state stays
# bf16, its page halves, and vLLM unifies the block at 32 tokens instead of 64 (the granite
# model then breaks vLLM's CPU Mamba2 scan, whose chunk must equal the block).
SSM_STATE = {"mamba_ssm_cache_dtype": "float32"}
MODELS = {
    "qwen3_next": {"builder": build_qwen3_next, "engine_args": {**SSM_STATE},
                   "pressure": {"bytes": 4 * 1024 * 1024, "prompt": 200, "max_tokens": 48,
                                "preemption_invariant": True}},
    # One 64-token chunk per step: requests are admitted one at a time, so only requests
    # that grow by whole blocks while decoding make vLLM preempt. vLLM's CPU Mamba2 is not
    # preemption-invariant by itself: a preempted request recomputes its generated tokens
    # as a prefill chunk, which rounds differently from decoding them one by one (measured
    # without any connector: 3 of 8 requests changed tokens after 25-129 positions with 5
    # preemptions vs none). Only what precedes any decode is compared exactly there.
    "granite_hybrid": {"builder": build_granite_hybrid,
                       "engine_args": {"max_num_batched_tokens": BLOCK, **SSM_STATE},
                       "pressure": {"bytes": 384 * 1024, "prompt": 180, "max_tokens": 80,
                                    "preemption_invariant": False}},
}


def connector_config(fs_root: Path | None, *, module: str = "kv_offload.vllm",
                     name: str = "KVOffloadConnector") -> dict[str, Any]:
    extra: dict[str, Any] = {"cpu_bytes_to_use": "128MiB"}
    if fs_root is not None:
        extra.update(storage_tier="filesystem",
                     storage_options={"root_dir": str(fs_root), "bytes_to_use": "512MiB"})
    return {"kv_connector": name, "kv_connector_module_path": module, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


NO_RESTORE = {"module": "no_state_restore", "name": "NoStateRestoreConnector"}


def spec(model: str, model_dir: Path, passes: list[dict], kv_transfer_config: dict | None = None,
         **extra: Any) -> dict[str, Any]:
    engine_args: dict[str, Any] = {"max_model_len": 1024, **MODELS[model]["engine_args"]}
    if kv_transfer_config is not None:
        engine_args["kv_transfer_config"] = kv_transfer_config
    engine_args.update(extra.pop("engine_args", {}))
    return {"model": str(model_dir), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "logprobs": LOGPROBS, "passes": passes, "engine_args": engine_args, **extra}


def outputs(pass_result: dict[str, Any]) -> list[tuple[list[int], list[dict]]]:
    return [(r["token_ids"], r["logprobs"]) for r in pass_result["requests"]]


def cached(pass_result: dict[str, Any]) -> list[int]:
    return [r["num_cached_tokens"] for r in pass_result["requests"]]


def full_prefixes(pass_result: dict[str, Any]) -> list[int]:
    """Whole blocks, never the last prompt token: what a full prefix hit covers."""
    return [(r["prompt_len"] - 1) // BLOCK * BLOCK for r in pass_result["requests"]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mamba_models")
    return {model: MODELS[model]["builder"](root / model) for model in MODELS}


@pytest.fixture(scope="module", params=list(MODELS))
def runs(request, model_dirs, tmp_path_factory) -> dict[str, Any]:
    """Per model: a run without the connector (the prompts, then the longer prompts with
    vLLM's own cache warm: its own hit is the reference), a connector run writing through to
    a disk directory (cold; after vLLM's cache reset; the longer prompts after another
    reset), and the negative control (cold; after the reset)."""
    model = request.param
    work = tmp_path_factory.mktemp(f"mamba_{model}")
    model_dir = model_dirs[model]
    fs_root = work / "kv"
    # One at a time: vLLM's own hits are immediate and ours arrive a step later, so batched
    # requests would meet in different batches, and bf16 kernels round by batch shape.
    longer = {"prompts": LONGER, "one_at_a_time": True}
    baseline = run_engine(spec(model, model_dir, [{}, longer]), work / "baseline")
    offload = run_engine(
        spec(model, model_dir, [{}, {"reset_prefix_cache": True},
                                {"reset_prefix_cache": True, **longer}],
             connector_config(fs_root), metrics_prefix="vllm:kv_offload",
             engine_args={"disable_log_stats": False}),
        work / "offload")
    no_restore = run_engine(
        spec(model, model_dir, [{}, {"reset_prefix_cache": True}],
             connector_config(None, **NO_RESTORE)),
        work / "no_restore")
    return {"model": model, "model_dir": model_dir, "work": work, "fs_root": fs_root,
            "baseline": baseline, "offload": offload, "no_restore": no_restore}


def test_engine_builds_mamba_groups_with_64_token_blocks(runs):
    log = (runs["work"] / "offload" / "engine.log").read_text()
    assert "Mamba" in log or "mamba" in log
    # The hit lengths asserted below are multiples of BLOCK; a cold pass of a 150-token
    # prompt would not hit 128 tokens with another block size.
    _, from_host, _ = runs["offload"]["passes"]
    assert cached(from_host)[0] == 128


def test_outputs_identical_with_connector(runs):
    baseline = outputs(runs["baseline"]["passes"][0])
    cold, from_host, _ = runs["offload"]["passes"]
    assert cached(cold) == [0] * len(PROMPTS)
    assert outputs(cold) == baseline
    assert outputs(from_host) == baseline


def test_not_restoring_the_state_changes_outputs(runs):
    """The negative control: same hits, attention loaded, Mamba-type states not restored."""
    cold, hit = runs["no_restore"]["passes"]
    baseline = outputs(runs["baseline"]["passes"][0])
    assert outputs(cold) == baseline  # nothing loaded yet: the control itself is sound
    assert cached(hit) == full_prefixes(hit)  # it did take the hits
    differing = [i for i, (got, want) in enumerate(zip(outputs(hit), baseline)) if got != want]
    assert differing, "the model ignores its recurrent state: these tests prove nothing"


def test_reset_engine_cache_is_served_from_host_tier(runs):
    """vLLM's cache is empty after the reset: every cached token came from our tier, up to
    the last block boundary with a stored state (here: every whole block of the prompt)."""
    _, from_host, _ = runs["offload"]["passes"]
    assert cached(from_host) == full_prefixes(from_host)


def test_connector_metrics_count_the_hits(runs):
    by_name: dict[str, float] = {}
    for metric in runs["offload"]["metrics"]:
        by_name[metric["name"]] = by_name.get(metric["name"], 0.0) + metric["value"]
    _, from_host, longer = runs["offload"]["passes"]
    assert by_name["vllm:kv_offload_hit_tokens"] == sum(cached(from_host)) + sum(cached(longer))
    assert by_name["vllm:kv_offload_loaded_bytes"] > 0


def test_longer_prompt_hits_where_vllm_itself_would_and_no_further(runs):
    """A longer prompt sharing a stored prompt hits at the longest boundary where every
    group has what its rule needs (attention: all blocks; Mamba: the state at exactly that
    boundary): the same length vLLM's own warm prefix cache hits, never a token more."""
    _, own_cache = runs["baseline"]["passes"]
    *_, longer = runs["offload"]["passes"]
    assert cached(longer) == cached(own_cache)
    assert all(hit > 0 for hit in cached(longer))
    _, from_host, _ = runs["offload"]["passes"]
    stored = [from_host["requests"][i]["prompt_len"] // BLOCK * BLOCK for i in (0, 2)]
    assert all(hit <= limit for hit, limit in zip(cached(longer), stored))  # the shared part
    assert outputs(longer) == outputs(own_cache)


def test_new_process_is_served_from_disk(runs):
    assert any(runs["fs_root"].rglob("*.safetensors"))
    fresh = run_engine(spec(runs["model"], runs["model_dir"], [{}],
                            connector_config(runs["fs_root"])),
                       runs["work"] / "from_disk")
    (first,) = fresh["passes"]
    assert cached(first) == full_prefixes(first)
    assert outputs(first) == outputs(runs["baseline"]["passes"][0])


def test_corrupted_disk_files_are_recomputed(runs):
    """Flip a byte inside the data of every stored file (Mamba states and attention blocks):
    every read fails its checksum (a load's or the read probe's), the requests recompute,
    outputs stay identical."""
    corrupt_root = runs["work"] / "kv_corrupt"
    shutil.copytree(runs["fs_root"], corrupt_root)
    files = sorted(corrupt_root.rglob("*.safetensors"))
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF  # last bytes are page data, not the header
        path.write_bytes(bytes(data))
    result = run_engine(spec(runs["model"], runs["model_dir"], [{}, {}],
                             connector_config(corrupt_root)),
                        runs["work"] / "corrupt")
    first, second = result["passes"]
    baseline = outputs(runs["baseline"]["passes"][0])
    assert outputs(first) == baseline
    assert outputs(second) == baseline
    assert cached(first) == [0] * len(PROMPTS)  # nothing usable was served
    log = (runs["work"] / "corrupt" / "engine.log").read_text()  # (refused by a load, or
    assert "will be recomputed" in log or "refused and removed" in log  # by the read probe)


@pytest.mark.parametrize("model", list(MODELS))
def test_preemption_under_memory_pressure_keeps_outputs_identical(model, model_dirs, tmp_path):
    """A KV cache of 16-24 blocks for eight requests: vLLM preempts and re-admits
    requests (freeing and reusing state blocks) while our stores and loads are in flight."""
    sizes = MODELS[model]["pressure"]
    prompts = [word_prompt(sizes["prompt"], offset=50 * i) for i in range(8)]
    pressure = {"kv_cache_memory_bytes": sizes["bytes"], "max_model_len": 512,
                "disable_log_stats": False}
    common = {"prompts": prompts, "max_tokens": sizes["max_tokens"],
              "metrics_prefix": "vllm:num_preemptions"}
    baseline = run_engine({**spec(model, model_dirs[model], [{}], engine_args=pressure),
                           **common}, tmp_path / "baseline")
    result = run_engine(
        {**spec(model, model_dirs[model], [{}, {"reset_prefix_cache": True}],
                connector_config(None), engine_args=pressure), **common},
        tmp_path / "offload")
    preemptions = sum(m["value"] for m in result["metrics"])
    assert preemptions > 0, "the test lost its point: vLLM did not preempt"
    cold, again = result["passes"]
    assert sum(r["num_cached_tokens"] for r in again["requests"]) > 0
    (want,) = baseline["passes"]
    if sizes["preemption_invariant"]:
        assert token_ids(cold) == token_ids(want)
        assert token_ids(again) == token_ids(want)
    else:  # the first token and its top-5 logprobs: the prompt's state, restored or not
        def first(pass_result: dict[str, Any]) -> list[tuple[int, dict]]:
            return [(toks[0], lps[0]) for toks, lps in outputs(pass_result)]

        assert first(cold) == first(want)
        assert first(again) == first(want)
