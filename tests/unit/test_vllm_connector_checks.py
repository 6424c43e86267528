"""What the connector refuses at engine start, with vLLM's real config classes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import CacheConfig, ParallelConfig, VllmConfig  # noqa: E402

from kv_offload.errors import ConfigError  # noqa: E402
from kv_offload.specs import FullAttentionSpec, KVCacheGroup, MambaSpec  # noqa: E402
from kv_offload.vllm.connector import _refuse_unsupported  # noqa: E402
from kv_offload.vllm.mamba_states import check_mamba_servable  # noqa: E402


# (vLLM 0.32's V1 model runner refuses prefill context parallelism itself.)
@pytest.mark.parametrize("name", ["decode_context_parallel_size"])
def test_context_parallelism_is_refused_by_name(name):
    config = VllmConfig(parallel_config=ParallelConfig(**{name: 2, "tensor_parallel_size": 2}))
    with pytest.raises(ConfigError, match=f"{name}=2"):
        _refuse_unsupported(config)


def test_plain_tensor_parallelism_passes():
    _refuse_unsupported(VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2)))


ATTENTION = KVCacheGroup(["layers.0.attn"], FullAttentionSpec(
    block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16))
MAMBA = KVCacheGroup(["layers.1.mixer"], MambaSpec(32, ((3, 64),), (torch.bfloat16,)))


@pytest.mark.parametrize("cache", [dict(enable_prefix_caching=False),
                                   dict(enable_prefix_caching=True, mamba_cache_mode="none")])
def test_mamba_groups_without_align_mode_are_refused_naming_the_setting(cache):
    config = VllmConfig(cache_config=CacheConfig(**cache))
    check_mamba_servable([ATTENTION], config)  # no Mamba group: nothing to refuse
    with pytest.raises(ConfigError, match=r"group 1 \(layers \['layers.1.mixer'\].*"
                                          r"enable_prefix_caching"):
        check_mamba_servable([ATTENTION, MAMBA], config)


def test_mamba_groups_in_align_mode_are_served():
    config = VllmConfig(cache_config=CacheConfig(enable_prefix_caching=True,
                                                 mamba_cache_mode="align"))
    check_mamba_servable([ATTENTION, MAMBA], config)


def test_mamba_groups_with_speculative_blocks_are_refused_naming_the_setting():
    config = VllmConfig(cache_config=CacheConfig(enable_prefix_caching=True,
                                                 mamba_cache_mode="align"))
    speculative = KVCacheGroup(["layers.1.mixer"], MambaSpec(
        32, ((3, 64),), (torch.bfloat16,), num_speculative_blocks=2))
    with pytest.raises(ConfigError, match="num_speculative_blocks=2.*speculative_config"):
        check_mamba_servable([ATTENTION, speculative], config)
