"""What the connector refuses at engine start, with vLLM's real config classes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import CacheConfig, ParallelConfig, VllmConfig  # noqa: E402

from kv_offload.errors import ConfigError  # noqa: E402
from kv_offload.specs import FullAttentionSpec, KVCacheGroup, MambaSpec  # noqa: E402
from kv_offload.vllm.connector import _refuse_unsupported  # noqa: E402
from kv_offload.vllm.scheduler.mamba_states import check_mamba_servable  # noqa: E402


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


# --- checks vLLM runs through the connector class before an engine starts ---

from vllm.config import KVTransferConfig  # noqa: E402

from kv_offload.vllm.connector import KVOffloadConnector  # noqa: E402

BAD_CONFIGS = [  # (extra config, what the error must name)
    ({}, "cpu_bytes_to_use is required"),
    ({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use must be a byte size.*'lots'"),
    ({"cpu_bytes_to_use": "1GiB", "cpu_bytes": 1}, r"unknown key\(s\) \['cpu_bytes'\]"),
    ({"cpu_bytes_to_use": "1000TiB"}, "lower cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": "1GiB", "eviction_policy": "nope"}, "eviction_policy"),
]


def transfer_config(extra) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="KVOffloadConnector", kv_role="kv_both",
                            kv_connector_module_path="kv_offload.vllm",
                            kv_connector_extra_config=extra)


@pytest.mark.parametrize(("extra", "names"), BAD_CONFIGS)
def test_every_class_hook_vllm_calls_before_an_engine_starts_refuses_a_bad_config(extra,
                                                                                   names):
    hooks = [
        lambda: KVOffloadConnector.requires_piecewise_for_cudagraph(extra),
        lambda: KVOffloadConnector.get_required_kvcache_layout(
            VllmConfig(kv_transfer_config=transfer_config(extra))),
        lambda: KVOffloadConnector.supports_sleep_mode(transfer_config(extra)),
    ]
    for hook in hooks:
        with pytest.raises(ConfigError, match=names):
            hook()


def test_the_class_hooks_answer_neutrally_for_a_good_config(tmp_path):
    extra = {"cpu_bytes_to_use": "64MiB", "storage_tier": "filesystem",
             "storage_options": {"root_dir": str(tmp_path / "kv"), "bytes_to_use": "1GiB"}}
    assert KVOffloadConnector.requires_piecewise_for_cudagraph(extra) is False
    assert KVOffloadConnector.get_required_kvcache_layout(
        VllmConfig(kv_transfer_config=transfer_config(extra))) is None
    assert KVOffloadConnector.supports_sleep_mode(transfer_config(extra)) is True
