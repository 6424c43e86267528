"""vLLM 0.32/0.33 KV-cache specs -> kv-offload specs, built from vLLM's real spec classes."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1 import kv_cache_interface as vkv  # noqa: E402

from kv_offload import default_registry, find_longest_cache_hit  # noqa: E402
from kv_offload import specs as ours  # noqa: E402
from kv_offload.errors import ConfigError  # noqa: E402
from kv_offload.hits import blocks_worth_storing  # noqa: E402
from kv_offload.vllm.spec_translation import (  # noqa: E402
    REFUSED,
    TRANSLATED,
    register_vllm_spec,
    translate_groups,
    translate_spec,
)

ATTN = dict(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def _same_fields(theirs: object, mine: object, names: list[str]) -> None:
    for name in names:
        assert getattr(mine, name) == getattr(theirs, name), name


@pytest.mark.parametrize("vllm_spec, our_type, fields", [
    (vkv.FullAttentionSpec(**ATTN), ours.FullAttentionSpec,
     ["block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window"]),
    (vkv.FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=128, head_size_v=64,
                           dtype=torch.float16, page_size_padded=40960, sliding_window=512),
     ours.FullAttentionSpec,
     ["block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "page_size_padded",
      "sliding_window"]),
    (vkv.SlidingWindowSpec(sliding_window=64, **ATTN), ours.SlidingWindowSpec,
     ["block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window"]),
    (vkv.ChunkedLocalAttentionSpec(attention_chunk_size=128, **ATTN),
     ours.ChunkedLocalAttentionSpec, ["block_size", "attention_chunk_size", "head_size"]),
    (vkv.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
     ours.MLAAttentionSpec, ["block_size", "num_kv_heads", "head_size", "head_size_v", "dtype"]),
    (vkv.SinkFullAttentionSpec(sink_len=4, **ATTN), ours.SinkFullAttentionSpec,
     ["block_size", "num_kv_heads", "head_size", "sink_len"]),
    (vkv.CrossAttentionSpec(**ATTN), ours.CrossAttentionSpec, ["block_size", "head_size"]),
    (vkv.MambaSpec(block_size=64, shapes=((3, 128), (4, 16, 16)),
                   dtypes=(torch.bfloat16, torch.float32), page_size_padded=8192),
     ours.MambaSpec, ["block_size", "shapes", "dtypes", "page_size_padded"]),
], ids=["full", "full-padded-window", "swa", "chunked", "mla", "sink", "cross",
        "mamba"])
def test_known_specs_keep_their_fields_and_page_size(vllm_spec, our_type, fields):
    mine = translate_spec(vllm_spec, "layer 'x'")
    assert type(mine) is our_type
    _same_fields(vllm_spec, mine, fields)
    assert mine.page_size_bytes == vllm_spec.page_size_bytes
    assert mine.real_page_size_bytes == vllm_spec.real_page_size_bytes


def test_mla_alignment_padding_is_carried():
    vllm_spec = vkv.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576,
                                     dtype=torch.bfloat16, alignment=65536 + 4096)
    assert vllm_spec.page_size_bytes > vllm_spec.real_page_size_bytes  # vLLM padded it
    mine = translate_spec(vllm_spec, "g")
    assert (mine.page_size_bytes, mine.real_page_size_bytes) == (
        vllm_spec.page_size_bytes, vllm_spec.real_page_size_bytes)


def test_mamba_type_becomes_a_string():
    mine = translate_spec(vkv.MambaSpec(block_size=16, shapes=((4, 8),),
                                        dtypes=(torch.float32,)), "g")
    assert isinstance(mine.mamba_type, str) and mine.mamba_type


def test_uniform_type_translates_every_layer():
    a = vkv.FullAttentionSpec(**ATTN)
    b = vkv.FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=128, dtype=torch.float16)
    vllm_spec = vkv.UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={"l0": a, "l1": b})
    mine = translate_spec(vllm_spec, "g")
    assert isinstance(mine, ours.UniformTypeKVCacheSpecs)
    assert list(mine.kv_cache_specs) == ["l0", "l1"]
    assert mine.kv_cache_specs["l1"].num_kv_heads == 4
    assert mine.kv_cache_specs["l1"].dtype == torch.float16
    assert mine.page_size_bytes == vllm_spec.page_size_bytes
    assert mine.spec_for("l0").page_size_bytes == a.page_size_bytes


def test_uniform_type_with_an_unknown_layer_is_refused_naming_the_layer():
    bad = vkv.RSWASpec(rswa_window=64, **ATTN)
    vllm_spec = vkv.UniformTypeKVCacheSpecs(
        block_size=32, kv_cache_specs={"l0": vkv.FullAttentionSpec(**ATTN), "l7": bad})
    with pytest.raises(ConfigError, match="'l7'.*RSWASpec"):
        translate_spec(vllm_spec, "g")


def _config(*groups: tuple[list[str], object]) -> vkv.KVCacheConfig:
    page = max(spec.page_size_bytes for _, spec in groups)
    tensors = [vkv.KVCacheTensor(size=page * 8 * 2, layers=names, layer_stride=page * 8,
                                 block_stride=page) for names, _ in groups]
    return vkv.KVCacheConfig(
        num_blocks=8, kv_cache_tensors=tensors,
        kv_cache_groups=[vkv.KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)
                         for names, spec in groups])


def test_groups_keep_vllm_order_and_layer_names():
    swa = vkv.SlidingWindowSpec(sliding_window=64, **ATTN)
    full = vkv.FullAttentionSpec(**ATTN)
    groups = translate_groups(_config((["layers.0", "layers.2"], swa),
                                      (["layers.1", "layers.3"], full)))
    assert [g.layer_names for g in groups] == [["layers.0", "layers.2"], ["layers.1", "layers.3"]]
    assert isinstance(groups[0].spec, ours.SlidingWindowSpec)
    assert groups[0].spec.sliding_window == 64
    assert type(groups[1].spec) is ours.FullAttentionSpec
    assert [g.spec.page_size_bytes for g in groups] == [swa.page_size_bytes,
                                                         full.page_size_bytes]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _HotCacheSpec(vkv.KVCacheSpec):
    """An out-of-tree vLLM spec type (a subclass of vLLM's real KVCacheSpec)."""

    bytes_per_token: int

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.bytes_per_token


@pytest.mark.parametrize("vllm_spec", [
    vkv.HiSparseHotSpec(block_size=32, page_size=4096, blocks_per_request=4),
    _HotCacheSpec(block_size=32, bytes_per_token=128),
    vkv.RSWASpec(rswa_window=64, **ATTN),  # a FullAttentionSpec subclass is not full attention
], ids=["hisparse", "custom", "rswa-subclass"])
def test_unknown_spec_types_are_refused_with_the_way_out(vllm_spec):
    name = type(vllm_spec).__name__
    with pytest.raises(ConfigError) as err:
        translate_groups(_config((["layers.5"], vllm_spec)))
    message = str(err.value)
    assert name in message and "register_vllm_spec" in message
    assert "group 0" in message and "layers.5" in message


@pytest.mark.parametrize("mode", [vkv.KVQuantMode.FP8_PER_TENSOR,
                                  vkv.KVQuantMode.INT8_PER_TOKEN_HEAD, vkv.KVQuantMode.NVFP4])
def test_quantised_kv_is_refused(mode):
    for spec in (vkv.FullAttentionSpec(kv_quant_mode=mode, **ATTN),
                 vkv.SlidingWindowSpec(sliding_window=64, kv_quant_mode=mode, **ATTN)):
        with pytest.raises(ConfigError, match="kv_quant_mode"):
            translate_spec(spec, "layer 'q'")


@pytest.mark.parametrize("extra, field", [
    (dict(num_head_slots=4), "num_head_slots"),
    (dict(state_content_bytes=96), "state_content_bytes"),
    (dict(tokens_per_state=4), "tokens_per_state"),
])
def test_packed_or_compressed_pages_are_refused(extra, field):
    with pytest.raises(ConfigError, match=field):
        translate_spec(vkv.FullAttentionSpec(**ATTN, **extra), "layer 'p'")


def test_invalid_values_become_config_errors_naming_the_place():
    # Chunks that do not start on block boundaries cannot be hit-checked.
    spec = vkv.ChunkedLocalAttentionSpec(attention_chunk_size=48, **ATTN)
    with pytest.raises(ConfigError, match="layer 'c'.*ChunkedLocalAttentionSpec"):
        translate_spec(spec, "layer 'c'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _LatentCacheSpec(vkv.KVCacheSpec):
    """Another out-of-tree type, taught to the connector by the test below."""

    latent_bytes: int

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.latent_bytes


def test_register_vllm_spec_makes_a_custom_type_work():
    vllm_spec = _LatentCacheSpec(block_size=32, latent_bytes=1152)
    with pytest.raises(ConfigError, match="_LatentCacheSpec"):
        translate_spec(vllm_spec, "g")

    def translate(spec: _LatentCacheSpec) -> ours.KVCacheSpec:
        return ours.MLAAttentionSpec(block_size=spec.block_size, num_kv_heads=1,
                                     head_size=spec.latent_bytes // 2, dtype=torch.bfloat16)

    register_vllm_spec(_LatentCacheSpec, translate)
    groups = translate_groups(_config((["layers.0"], vllm_spec)))
    assert isinstance(groups[0].spec, ours.MLAAttentionSpec)
    assert groups[0].spec.page_size_bytes == vllm_spec.page_size_bytes
    # Only that exact class was registered: the other custom type is still refused.
    with pytest.raises(ConfigError, match="register_vllm_spec"):
        translate_spec(_HotCacheSpec(block_size=32, bytes_per_token=8), "g")


# ---- every spec class vLLM defines: translated, or refused by name ----

_HAS_BOUNDED_REPLAY = "bounded_replay" in {
    f.name for f in dataclasses.fields(vkv.SlidingWindowMLASpec)}
_MLA = dict(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)

# One instance of each spec class vLLM's kv_cache_interface defines (vLLM 0.32 and 0.33).
_EXAMPLES = {
    "KVCacheSpec": lambda: vkv.KVCacheSpec(block_size=32),
    "AttentionSpec": lambda: vkv.AttentionSpec(**ATTN),
    "FullAttentionSpec": lambda: vkv.FullAttentionSpec(**ATTN),
    "MLAAttentionSpec": lambda: vkv.MLAAttentionSpec(**_MLA),
    "HiddenStateCacheSpec": lambda: vkv.HiddenStateCacheSpec(**_MLA),
    "RSWASpec": lambda: vkv.RSWASpec(rswa_window=64, **ATTN),
    "ChunkedLocalAttentionSpec": lambda: vkv.ChunkedLocalAttentionSpec(
        attention_chunk_size=128, **ATTN),
    "SlidingWindowSpec": lambda: vkv.SlidingWindowSpec(sliding_window=64, **ATTN),
    "CircularBufferSpec": lambda: vkv.CircularBufferSpec(**ATTN),
    "SlidingWindowMLASpec": lambda: vkv.SlidingWindowMLASpec(sliding_window=128, **_MLA),
    "MambaSpec": lambda: vkv.MambaSpec(block_size=64, shapes=((3, 128),),
                                       dtypes=(torch.bfloat16,)),
    "EncoderOnlyAttentionSpec": lambda: vkv.EncoderOnlyAttentionSpec(**ATTN),
    "CrossAttentionSpec": lambda: vkv.CrossAttentionSpec(**ATTN),
    "SinkFullAttentionSpec": lambda: vkv.SinkFullAttentionSpec(sink_len=32, **ATTN),
    "UniformTypeKVCacheSpecs": lambda: vkv.UniformTypeKVCacheSpecs(
        block_size=32, kv_cache_specs={"l0": vkv.FullAttentionSpec(**ATTN)}),
    "HiSparseHotSpec": lambda: vkv.HiSparseHotSpec(block_size=32, page_size=4096,
                                                   blocks_per_request=4),
    "HiSparseResidentSpec": lambda: vkv.HiSparseResidentSpec(block_size=32, page_size=4096),
}
_VLLM_SPEC_CLASSES = sorted(
    (cls for cls in vars(vkv).values() if isinstance(cls, type)
     and issubclass(cls, vkv.KVCacheSpec) and cls.__module__ == vkv.__name__),
    key=lambda cls: cls.__name__)


@pytest.mark.parametrize("vllm_cls", _VLLM_SPEC_CLASSES, ids=lambda cls: cls.__name__)
def test_every_spec_class_vllm_defines_is_translated_or_refused_by_name(vllm_cls):
    name = vllm_cls.__name__
    assert (name in TRANSLATED) != (name in REFUSED), (
        f"vLLM's {name} must be in exactly one of spec_translation.TRANSLATED / REFUSED")
    assert name in _EXAMPLES, f"a new vLLM spec class: add an example of {name} here"
    vllm_spec = _EXAMPLES[name]()
    assert type(vllm_spec) is vllm_cls
    config = vkv.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        vkv.KVCacheGroupSpec(layer_names=["layers.3", "layers.9"], kv_cache_spec=vllm_spec)])
    if name in REFUSED:
        with pytest.raises(ConfigError) as err:
            translate_groups(config)
        message = str(err.value)
        assert name in message and "group 0" in message and "layers.3" in message
        assert REFUSED[name] in message
    else:
        (group,) = translate_groups(config)
        assert group.layer_names == ["layers.3", "layers.9"]
        assert group.spec.page_size_bytes == vllm_spec.page_size_bytes


def test_a_sliding_window_over_mla_latents_hits_like_a_sliding_window():
    vllm_spec = vkv.SlidingWindowMLASpec(sliding_window=128, alignment=40960, **_MLA)
    mine = translate_spec(vllm_spec, "g")
    assert type(mine) is ours.SlidingWindowMLASpec and mine.head_size_v == 0
    assert (mine.page_size_bytes, mine.real_page_size_bytes) == (
        vllm_spec.page_size_bytes, vllm_spec.real_page_size_bytes)
    assert mine.prefix_replay_tokens == 0
    # Window 128 = 4 blocks: a hit at block 8 needs blocks 4..7 only.
    hit = find_longest_cache_hit([mine], lambda g, i: i >= 4, 8 * 32 + 5)
    assert (hit.num_tokens, hit.blocks) == (8 * 32, [[4, 5, 6, 7]])


@pytest.mark.skipif(not _HAS_BOUNDED_REPLAY, reason="this vLLM's SlidingWindowMLASpec has no "
                    "bounded_replay (DeepSeek-V4.1's replay groups)")
def test_a_bounded_replay_window_neither_bounds_nor_loads_a_hit_and_is_never_stored():
    replayed = vkv.SlidingWindowMLASpec(sliding_window=128, bounded_replay=True, **_MLA)
    specs = [translate_spec(vkv.FullAttentionSpec(**ATTN), "g0"),
             translate_spec(replayed, "g1")]
    assert specs[1].prefix_replay_tokens == replayed.prefix_replay_tokens == 128
    # Nothing of the replayed group is cached, yet the full-attention prefix is the hit.
    hit = find_longest_cache_hit(specs, lambda g, i: g == 0 and i < 6, 10 * 32)
    assert (hit.num_tokens, hit.blocks) == (6 * 32, [list(range(6)), []])
    assert blocks_worth_storing(specs[1], 10) == []
    # A replayed window never shares a group with a stored one.
    plain = translate_spec(vkv.SlidingWindowMLASpec(sliding_window=128, **_MLA), "g2")
    assert not default_registry.is_uniform([specs[1], plain])
