"""The weights identity: every byte of every weight file, or the operator's name for them."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from kv_offload.errors import ConfigError
from kv_offload.runtime.file_digests import FileDigests
from kv_offload.vllm.weights import (
    PendingWeights,
    identify_weights,
    looks_remote,
    require_identity,
    weight_files,
)

from helpers.weight_edits import edit_tensor_in_place, tensor_span

NORM = "model.layers.0.input_layernorm.weight"


@pytest.fixture
def digests(tmp_path):
    return FileDigests(tmp_path / "digest-cache")


@pytest.fixture
def model_dir(tmp_path):
    """A shard of about 8 MiB: large tensors around one 512-byte norm weight, placed so
    that a sampled digest (16 samples of 64 KiB: the previous identity) does not see it."""
    directory = tmp_path / "model"
    directory.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(1024, 1024, generator=gen)
               .to(torch.bfloat16),
               NORM: torch.ones(256, dtype=torch.bfloat16),
               "model.layers.0.mlp.weight": torch.randn(1024, 1024, generator=gen)
               .to(torch.bfloat16),
               "lm_head.weight": torch.randn(64, 1024, generator=gen).to(torch.bfloat16)}
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text("{}")
    return directory


def sampled_positions(size: int, samples: int = 16, sample_bytes: int = 64 << 10):
    """Where the previous identity read (for the test's own claim about its fixture)."""
    return [(max(0, size - sample_bytes) * i // (samples - 1),
             max(0, size - sample_bytes) * i // (samples - 1) + sample_bytes)
            for i in range(samples)]


def test_one_small_tensor_edited_in_place_with_mtime_restored_is_another_model(
        model_dir, digests):
    shard = model_dir / "model.safetensors"
    start, end = tensor_span(shard, NORM)
    assert end - start == 512
    # (the previous, sampled identity read none of these bytes: it kept its value)
    assert all(end <= a or start >= b for a, b in sampled_positions(shard.stat().st_size))
    before = identify_weights(str(model_dir), digests=digests)
    edit_tensor_in_place(shard, NORM, restore_mtime=True)
    after = identify_weights(str(model_dir), digests=digests)
    assert after.digest != before.digest
    assert after.read_bytes == shard.stat().st_size  # (read again: ctime moved)


def test_a_restart_over_the_same_weights_reads_nothing_and_agrees(model_dir, digests):
    first = identify_weights(str(model_dir), digests=digests)
    again = identify_weights(str(model_dir), digests=digests)
    assert first.read_bytes > 0 and again.read_bytes == 0
    assert again.digest == first.digest
    assert "remembered" in again.describe()


def test_the_same_weights_elsewhere_are_the_same_model(model_dir, tmp_path, digests):
    import shutil

    copy = shutil.copytree(model_dir, tmp_path / "elsewhere")
    assert identify_weights(str(copy), digests=digests).digest == \
        identify_weights(str(model_dir), digests=digests).digest


def test_a_renamed_or_added_weight_file_is_another_model(model_dir, digests):
    before = identify_weights(str(model_dir), digests=digests).digest
    extra = model_dir / "adapter.safetensors"
    save_file({"x": torch.zeros(4)}, extra)
    with_extra = identify_weights(str(model_dir), digests=digests).digest
    extra.rename(model_dir / "other.safetensors")
    renamed = identify_weights(str(model_dir), digests=digests).digest
    assert len({before, with_extra, renamed}) == 3


def test_a_single_file_model_is_identified_by_its_content(tmp_path, digests):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(1 << 20))
    found = weight_files(str(gguf))
    assert found.files == (gguf,)
    before = identify_weights(str(gguf), digests=digests)
    with open(gguf, "r+b") as f:
        f.seek(700_000)
        f.write(b"\0")
    assert identify_weights(str(gguf), digests=digests).digest != before.digest


def test_a_hub_cache_snapshot_is_found_without_network_and_read_through_its_links(
        tmp_path, monkeypatch, digests):
    """The hub cache's layout: snapshots/<revision>/<file> links to blobs/<sha256>."""
    hub = tmp_path / "hub"
    repo = hub / "models--acme--tiny"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    blob = repo / "blobs" / "aa11"
    save_file({"w": torch.arange(1000, dtype=torch.float32)}, blob)
    (snapshot / "model.safetensors").symlink_to(os.path.relpath(blob, snapshot))
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    found = weight_files("acme/tiny")
    assert found is not None and found.root == snapshot
    identity = identify_weights("acme/tiny", digests=digests)
    save_file({"w": torch.arange(1000, dtype=torch.float32) + 1}, blob)  # (edited blob)
    assert identify_weights("acme/tiny", digests=digests).digest != identity.digest


def test_model_identity_names_the_weights_without_reading_them(tmp_path):
    named = identify_weights(str(tmp_path / "absent"), named="deploy-2026-12-01")
    assert named.source == "model_identity" and named.read_bytes == 0
    assert named.digest != identify_weights("x", named="deploy-2026-12-02").digest


def test_a_model_without_local_weights_has_no_identity(digests):
    assert identify_weights("no-such-org/no-such-model", digests=digests) is None
    assert looks_remote("s3://bucket/models/llama")


def test_no_identity_with_a_storage_tier_is_refused_naming_model_identity():
    require_identity(None, "s3://bucket/llama", None)  # host memory only: keyed by name
    with pytest.raises(ConfigError, match="model_identity") as err:
        require_identity(None, "s3://bucket/llama", "valkey")
    assert "s3://bucket/llama" in str(err.value)


def test_the_identity_worked_out_early_is_checked_again_when_asked(model_dir, digests):
    """Started as the connector is built; the files may change before the store opens."""
    pending = PendingWeights(str(model_dir), None, digests=digests)
    early = pending.result()
    edit_tensor_in_place(model_dir / "model.safetensors", NORM)
    assert pending.result().digest != early.digest
