"""What the connector refuses at engine start, with vLLM's real config classes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import ParallelConfig, VllmConfig  # noqa: E402

from kv_offload.errors import ConfigError  # noqa: E402
from kv_offload.specs import FullAttentionSpec, KVCacheGroup, MambaSpec  # noqa: E402
from kv_offload.vllm.connector import _refuse_mamba, _refuse_unsupported  # noqa: E402


# (vLLM 0.32's V1 model runner refuses prefill context parallelism itself.)
@pytest.mark.parametrize("name", ["decode_context_parallel_size"])
def test_context_parallelism_is_refused_by_name(name):
    config = VllmConfig(parallel_config=ParallelConfig(**{name: 2, "tensor_parallel_size": 2}))
    with pytest.raises(ConfigError, match=f"{name}=2"):
        _refuse_unsupported(config)


def test_plain_tensor_parallelism_passes():
    _refuse_unsupported(VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2)))


def test_mamba_groups_are_refused_naming_the_group():
    attention = KVCacheGroup(["layers.0.attn"], FullAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16))
    mamba = KVCacheGroup(["layers.1.mixer"], MambaSpec(32, ((3, 64),), (torch.bfloat16,)))
    _refuse_mamba([attention])
    with pytest.raises(ConfigError, match=r"group 1 \(layers \['layers.1.mixer'\].*Mamba"):
        _refuse_mamba([attention, mamba])
