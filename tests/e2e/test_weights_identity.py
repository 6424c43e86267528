"""Stored KV is served only to the weights it was computed with, on the real vLLM CPU engine.

A fine-tune that rewrites one small tensor in place (the same files, sizes and header, its
mtime put back) is another model: a new engine over the same disk tier (with `secret_file`,
as a fleet would run it) serves none of what the old weights stored, and recomputes. The
same weights in a new engine are served in full (the control). The edited tensor is one
that the previous, sampled identity (16 reads of 64 KiB per file) did not read: under it,
the old KV was served to the edited model."""

from __future__ import annotations

import pytest
from engine_harness import run_engine

from kv_offload.testing.tiny_models import build_llama
from kv_offload.testing.tiny_vocab import word_prompt

from helpers.weight_edits import edit_tensor_in_place, tensor_span

pytestmark = pytest.mark.e2e

PROMPTS = [word_prompt(150), word_prompt(260, offset=400)]


def spec(model_dir, root, secret) -> dict:
    extra = {"cpu_bytes_to_use": "64MiB", "storage_tier": "filesystem",
             "storage_options": {"root_dir": str(root), "bytes_to_use": "256MiB"},
             "secret_file": str(secret)}
    return {"model": str(model_dir), "prompts": PROMPTS, "max_tokens": 4, "logprobs": 1,
            "passes": [{"one_at_a_time": True}],
            "engine_args": {"kv_transfer_config": {
                "kv_connector": "KVOffloadConnector",
                "kv_connector_module_path": "kv_offload.vllm", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}}}


def unsampled_norm(shard) -> str:
    """A layer's input norm weight (it feeds that layer's keys and values) that none of the
    previous identity's 16 samples of 64 KiB covered."""
    size, sample = shard.stat().st_size, 64 << 10
    read = [(max(0, size - sample) * i // 15, max(0, size - sample) * i // 15 + sample)
            for i in range(16)]
    for layer in range(4):
        name = f"model.layers.{layer}.input_layernorm.weight"
        start, end = tensor_span(shard, name)
        if all(end <= a or start >= b for a, b in read):
            return name
    raise AssertionError("every norm weight was sampled: make the model larger")


def cached(result) -> list[int]:
    return [r["num_cached_tokens"] for r in result["passes"][0]["requests"]]


def test_weights_edited_in_place_with_mtime_restored_are_not_served_the_old_kv(tmp_path):
    model = build_llama(tmp_path / "llama", layers=4, hidden=512, heads=8, kv_heads=4)
    [shard] = model.glob("*.safetensors")
    edited_tensor = unsampled_norm(shard)
    start, end = tensor_span(shard, edited_tensor)
    assert end - start <= 1024 and shard.stat().st_size > 16 << 20  # (1 KiB of > 16 MiB)
    secret = tmp_path / "secret"
    secret.write_bytes(b"a fleet's shared secret, 32 bytes")
    secret.chmod(0o600)
    root = tmp_path / "kv"

    first = run_engine(spec(model, root, secret), tmp_path / "first")
    assert cached(first) == [0, 0]
    same = run_engine(spec(model, root, secret), tmp_path / "same")
    assert all(c >= 128 for c in cached(same))  # served from the disk tier
    assert [r["token_ids"] for r in same["passes"][0]["requests"]] == \
        [r["token_ids"] for r in first["passes"][0]["requests"]]

    mtime = shard.stat().st_mtime_ns
    edit_tensor_in_place(shard, edited_tensor, restore_mtime=True)
    assert shard.stat().st_mtime_ns == mtime
    edited = run_engine(spec(model, root, secret), tmp_path / "edited")
    assert cached(edited) == [0, 0]  # another model: nothing of the old weights served
