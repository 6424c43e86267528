"""Many requests over one shared document, sent together to a new engine process whose
cache of that document is on disk only: every one of them hits (the loads of the same
blocks share one read). Before, the requests scheduled in the same step made each other's
loads fail and all of them recomputed the whole document. Real vLLM 0.32 CPU engine."""

from __future__ import annotations

import pytest
from engine_harness import cacheable_prefix, run_engine, token_ids
from test_connector import connector_config

from kv_offload.testing.tiny_vocab import word_prompt

pytestmark = pytest.mark.e2e

DOCUMENT = word_prompt(320)  # 10 engine blocks
QUESTIONS = [DOCUMENT + " " + word_prompt(7, offset=400 + 10 * i) for i in range(6)]


def test_every_request_over_a_shared_document_on_disk_hits(tiny_models, tmp_path):
    model, fs_root = tiny_models["llama"], tmp_path / "kv"
    common = {"model": str(model), "max_tokens": 4, "engine_args": {}}
    run_engine({**common, "prompts": [DOCUMENT], "passes": [{}],
                "engine_args": {"kv_transfer_config": connector_config(fs_root)}},
               tmp_path / "writer")
    fresh = run_engine({**common, "prompts": QUESTIONS, "passes": [{}],
                        "engine_args": {"kv_transfer_config": connector_config(fs_root)}},
                       tmp_path / "readers")
    baseline = run_engine({**common, "prompts": QUESTIONS, "passes": [{}]},
                          tmp_path / "baseline")
    (together,) = fresh["passes"]
    document_blocks = cacheable_prefix(len(DOCUMENT.split()) + 1)  # (+1: the BOS token)
    assert [r["num_cached_tokens"] for r in together["requests"]] == \
        [document_blocks] * len(QUESTIONS)
    assert token_ids(together) == token_ids(baseline["passes"][0])
