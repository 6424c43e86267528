"""Registers the built-in spec types with the default registry (imported by kv_offload)."""

from __future__ import annotations

from kv_offload import hit_rules
from kv_offload.layouts import attention_layout, mamba_layout
from kv_offload.registry import default_registry
from kv_offload.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)


def _sliding_window(spec: KVCacheSpec) -> int:
    return spec.sliding_window  # type: ignore[attr-defined]


def _replayed_window(spec: KVCacheSpec) -> tuple[int, bool]:
    return spec.sliding_window, spec.bounded_replay  # type: ignore[attr-defined]


def _chunk_size(spec: KVCacheSpec) -> int:
    return spec.attention_chunk_size  # type: ignore[attr-defined]


def _mamba_key(spec: KVCacheSpec) -> tuple[int, int]:
    return spec.num_speculative_blocks, spec.page_size_bytes  # type: ignore[attr-defined]


def register_builtin_specs() -> None:
    register = default_registry.register
    register(FullAttentionSpec, layout=attention_layout, hit_rule=hit_rules.FULL_ATTENTION_HIT)
    # MLA and sink attention keep every token, like full attention, and may share its group.
    register(MLAAttentionSpec, uniform_base=FullAttentionSpec)
    register(SinkFullAttentionSpec, uniform_base=FullAttentionSpec)
    register(SlidingWindowSpec, layout=attention_layout, hit_rule=hit_rules.SLIDING_WINDOW_HIT,
             uniform_key=_sliding_window)
    # Its own group type, as in vLLM: a replayed window never shares a group with a stored one.
    register(SlidingWindowMLASpec, layout=attention_layout,
             hit_rule=hit_rules.SLIDING_WINDOW_MLA_HIT, uniform_key=_replayed_window)
    register(ChunkedLocalAttentionSpec, layout=attention_layout,
             hit_rule=hit_rules.CHUNKED_LOCAL_HIT, uniform_key=_chunk_size)
    register(CrossAttentionSpec, layout=attention_layout, hit_rule=hit_rules.NO_PREFIX_HIT)
    register(MambaSpec, layout=mamba_layout, hit_rule=hit_rules.MAMBA_HIT, uniform_key=_mamba_key)


register_builtin_specs()
