"""Speculative decoding (vLLM's ngram drafter) on the real vLLM 0.32 CPU engine, under block
churn: a vLLM cache of 40 blocks for 6 prompts of 7 blocks each, vLLM's own cache reset
between rounds, so blocks we store are freed and handed out again while stores may run.

With a drafter, vLLM builds the worker's report before it hands the connector the step's
stores (`wait_for_save` deferred past the drafter); a report claiming those stores copied
out would let the next forward overwrite blocks still being stored. The unit tests drive the
worker in every call order (`tests/unit/vllm/worker/test_call_orders.py`); this test shows the
engine with a drafter generating exactly what it generates without the connector, with the
prompts served from our tiers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_harness import cacheable_prefix, run_engine, token_ids
from test_connector import connector_config

from kv_offload.testing.tiny_vocab import word_prompt

pytestmark = pytest.mark.e2e

# Repetitive prompts (each a phrase said again and again) give the ngram drafter matches.
PROMPTS = [" ".join([word_prompt(9, offset=40 * i)] * 25) for i in range(6)]  # 225 tokens
PAGE_BYTES = 16 * 1024  # tiny llama: 2 layers x 32 tokens x 2 KV heads x 32 x (K, V) x bf16
ENGINE_ARGS = {
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                           "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "kv_cache_memory_bytes": 40 * PAGE_BYTES,
    "max_model_len": 512,
    "max_num_seqs": 2,
    "disable_log_stats": False,
}
ROUNDS = 3
MAX_TOKENS = 24


def spec(model_dir: Path, kv_transfer_config: dict | None) -> dict:
    engine_args = dict(ENGINE_ARGS)
    if kv_transfer_config is not None:
        engine_args["kv_transfer_config"] = kv_transfer_config
    passes = [{"reset_prefix_cache": i > 0, "one_at_a_time": True} for i in range(ROUNDS)]
    return {"model": str(model_dir), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "passes": passes, "engine_args": engine_args, "metrics_prefix": "vllm:"}


def metric(result: dict, name: str) -> float:
    return sum(m["value"] for m in result["metrics"] if m["name"] == name)


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("speculative")
    model = tiny_models["llama"]
    return {"baseline": run_engine(spec(model, None), work / "baseline"),
            "offload": run_engine(spec(model, connector_config(work / "kv")), work / "offload")}


def test_the_drafter_really_proposes_and_vllm_accepts_tokens(runs):
    for result in runs.values():
        assert metric(result, "vllm:spec_decode_num_draft_tokens") > 0
        assert metric(result, "vllm:spec_decode_num_accepted_tokens") > 0


def test_with_a_drafter_and_block_churn_outputs_equal_the_engine_without_the_connector(runs):
    baseline, offload = runs["baseline"]["passes"], runs["offload"]["passes"]
    computed = token_ids(baseline[0])
    for round_ in range(ROUNDS):
        assert token_ids(offload[round_]) == computed, f"round {round_}"
        assert token_ids(baseline[round_]) == computed, f"round {round_} (no connector)"


def test_with_a_drafter_every_prompt_after_a_reset_is_served_from_our_tiers(runs):
    for pass_result in runs["offload"]["passes"][1:]:
        assert [r["num_cached_tokens"] for r in pass_result["requests"]] == \
            [cacheable_prefix(r["prompt_len"]) for r in pass_result["requests"]]
