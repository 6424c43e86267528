"""The fingerprint's engine part: what decides the bytes and the keys, and nothing else."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("vllm")

import vllm  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.v1 import kv_cache_interface as vkv  # noqa: E402

from kv_offload.testing.tiny_models import build_llama  # noqa: E402
from kv_offload.vllm.fingerprint import (  # noqa: E402
    EngineFingerprint,
    fingerprint_extra,
    hash_scheme_canary,
)
from kv_offload.vllm.spec_translation import translate_groups  # noqa: E402
from kv_offload.vllm.weights import identify_weights  # noqa: E402

# Two fixed blocks keyed by vLLM's own hashing. Computed with vLLM 0.32.0; CI runs this
# file again over vLLM 0.33.0's sources: the same values there are what lets a cache
# written under 0.32 serve 0.33.
CANARIES = {"sha256": "0c52f07440350346", "sha256_cbor": "570a47de21b68aa9"}


@pytest.fixture(autouse=True)
def engine_not_seeded_in_this_process(monkeypatch):
    """As in a worker process: vLLM's engine core, not the worker, seeds NONE_HASH (other
    tests in this process may have seeded it)."""
    from vllm.v1.core import kv_cache_utils

    monkeypatch.delattr(kv_cache_utils, "NONE_HASH", raising=False)


@pytest.mark.parametrize("algo", list(CANARIES))
def test_the_key_canary_is_the_same_under_every_supported_vllm(algo, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert vllm.__version__.startswith(("0.32", "0.33"))
    assert hash_scheme_canary(algo) == CANARIES[algo]


def test_another_hash_algorithm_or_seed_keys_blocks_differently(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    canaries = {algo: hash_scheme_canary(algo) for algo in ("sha256", "sha256_cbor",
                                                            "xxhash", "xxhash_cbor")}
    assert len(set(canaries.values())) == 4
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # vLLM seeds its first parent hash with it
    assert hash_scheme_canary("sha256") != canaries["sha256"]


def test_a_vllm_that_chains_block_hashes_differently_gets_another_canary():
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    def next_version(hash_fn, parent, tokens, extra_keys):  # e.g. a new field in the tuple
        return hash_fn((parent, tuple(tokens), extra_keys, "v2"))

    assert hash_scheme_canary("sha256", hash_block_tokens=hash_block_tokens) == \
        CANARIES["sha256"]
    assert hash_scheme_canary("sha256", hash_block_tokens=next_version) != CANARIES["sha256"]


@pytest.fixture
def model_dir(tmp_path):
    return build_llama(tmp_path / "llama", seed=0)


def test_without_a_weights_identity_the_model_is_keyed_by_name_and_revision(model_dir):
    named = engine_parts(str(model_dir), weights=False).shape
    assert f"model:{model_dir}@" in named
    assert named != engine_part(str(model_dir))


def engine_part(model: str, rank: int = 0, **cache) -> str:
    return engine_parts(model, rank, **cache).shape


def engine_parts(model: str, rank: int = 0, tp_size: int = 1, weights: bool = True,
                 **cache) -> EngineFingerprint:
    config = VllmConfig(model_config=ModelConfig(model=model),
                        cache_config=CacheConfig(**cache),
                        parallel_config=ParallelConfig())
    config.parallel_config.tensor_parallel_size = tp_size  # (no devices to check here)
    spec = vkv.FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32,
                                 dtype=config.model_config.dtype)
    kv_cache_config = vkv.KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[],
        kv_cache_groups=[vkv.KVCacheGroupSpec(["layers.0"], spec)])
    identity = identify_weights(model) if weights else None
    return fingerprint_extra(config, kv_cache_config, translate_groups(kv_cache_config), rank,
                             identity)


def test_the_engine_part_names_weights_and_key_scheme_not_the_path_or_the_version(
        model_dir, tmp_path):
    part = engine_part(str(model_dir))
    assert str(model_dir) not in part and vllm.__version__ not in part
    assert engine_part(str(shutil.copytree(model_dir, tmp_path / "b"))) == part
    assert engine_part(str(model_dir), rank=1) != part
    assert engine_part(str(model_dir), prefix_caching_hash_algo="sha256_cbor") != part
    build_llama(model_dir, seed=1)
    assert engine_part(str(model_dir)) != part


def test_the_shared_part_drops_the_tp_size_and_rank_and_keeps_the_model(model_dir):
    ranks = [engine_parts(str(model_dir), rank, tp) for tp in (1, 2) for rank in range(tp)]
    assert len({p.shape for p in ranks}) == 3  # a rank's own pages: per shape
    assert len({p.share.shared_extra for p in ranks}) == 1  # records: one namespace
    assert [(p.share.tp_size, p.share.tp_rank) for p in ranks] == [(1, 0), (2, 0), (2, 1)]
    assert ranks[0].share.total_kv_heads == ranks[2].share.total_kv_heads >= 1
    assert engine_parts(str(model_dir), prefix_caching_hash_algo="sha256_cbor") \
        .share.shared_extra != ranks[0].share.shared_extra
    build_llama(model_dir, seed=1)  # other weights: another namespace
    assert engine_parts(str(model_dir)).share.shared_extra != ranks[0].share.shared_extra
