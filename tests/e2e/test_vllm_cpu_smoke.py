"""The real vLLM 0.32 CPU engine serves our tiny local models, greedily and deterministically.

No connector here: this proves the test ground itself (model builders, engine settings,
engine prefix cache, reset) before the connector tests rely on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_harness import cacheable_prefix, run_engine, token_ids

from kv_offload.testing.tiny_vocab import word_prompt

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
# Longer than gemma3's 64-token window, not multiples of the 32-token engine block.
PROMPTS = [word_prompt(150), word_prompt(70, offset=200)]
PASSES = [{}, {}, {"reset_prefix_cache": True}]  # cold, engine prefix hit, cold again


def _spec(model_dir: Path) -> dict[str, Any]:
    return {"model": str(model_dir), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "passes": PASSES}


@pytest.fixture(scope="module")
def in_process_results(tiny_models, tmp_path_factory) -> dict[str, dict[str, Any]]:
    return {
        name: run_engine(_spec(tiny_models[name]), tmp_path_factory.mktemp(f"run_{name}"))
        for name in ("llama", "gemma3")
    }


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_greedy_outputs_identical_across_cache_states(in_process_results, model):
    cold, cached, after_reset = in_process_results[model]["passes"]
    for req, prompt in zip(cold["requests"], PROMPTS):
        assert req["prompt_len"] == len(prompt.split())
        assert len(req["token_ids"]) == MAX_TOKENS
    assert token_ids(cached) == token_ids(cold)
    assert token_ids(after_reset) == token_ids(cold)


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_engine_prefix_cache_hits_then_reset_clears_them(in_process_results, model):
    cold, cached, after_reset = in_process_results[model]["passes"]
    assert [r["num_cached_tokens"] for r in cold["requests"]] == [0, 0]
    assert [r["num_cached_tokens"] for r in cached["requests"]] == [
        cacheable_prefix(r["prompt_len"]) for r in cached["requests"]
    ]
    assert [r["num_cached_tokens"] for r in after_reset["requests"]] == [0, 0]


def test_multiprocess_engine_matches_in_process_engine(
    tiny_models, in_process_results, tmp_path
):
    """The deployed shape (engine core and worker in their own processes) gives the same
    tokens as the in-process engine the other e2e tests use to save time."""
    spec = {**_spec(tiny_models["llama"]), "passes": [{}]}
    result = run_engine(spec, tmp_path, multiprocess=True)
    assert token_ids(result["passes"][0]) == token_ids(in_process_results["llama"]["passes"][0])
