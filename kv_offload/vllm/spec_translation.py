"""vLLM 0.32/0.33 `KVCacheConfig` -> our `KVCacheGroup`s (specs with the same field names).

Only spec types we can canonicalise and hit-check exactly are translated; any other vLLM
spec type, or a known type using a feature we do not model (quantised KV, packed head
slots, compressed states), is refused with a `ConfigError` that names the layer, the type
and how to register a translation. Refusing is the safe answer: a guessed layout would
serve wrong bytes. Every spec class vLLM 0.33's `kv_cache_interface` defines is in
`TRANSLATED` or `REFUSED` (with the reason the error gives); a test enumerates them, so a
class a later vLLM adds is decided here before it is used.

DeepSeek-V4.1's bounded-replay groups (vLLM 0.33: `SlidingWindowMLASpec(bounded_replay=
True)`, `prefix_replay_tokens` = the window) translate to our `SlidingWindowMLASpec`, whose
hit rule (`hit_rules.ReplayedHit`) accepts any hit and loads nothing: such a group is never
stored nor served. vLLM's scheduler recomputes the hit's last window for it unless the
connector says its load restored every replay group (`get_loaded_kv_cache_group_ids`); we
never claim one, so the engine replays the window and takes the rest of the hit as loaded
(the other groups' KV in the replayed range is kept, not rewritten), and it drops a hit no
longer than the window: the scheduler side reports no such hit (`OffloadScheduler`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kv_offload import specs as ours
from kv_offload.errors import ConfigError
from kv_offload.specs import KVCacheGroup, KVCacheSpec

Translator = Callable[[Any], KVCacheSpec]

# vLLM spec class name -> our spec class; the vLLM fields of the same name are copied.
_BY_NAME: dict[str, type[KVCacheSpec]] = {
    "FullAttentionSpec": ours.FullAttentionSpec,
    "SlidingWindowSpec": ours.SlidingWindowSpec,
    "SlidingWindowMLASpec": ours.SlidingWindowMLASpec,
    "ChunkedLocalAttentionSpec": ours.ChunkedLocalAttentionSpec,
    "MLAAttentionSpec": ours.MLAAttentionSpec,
    "SinkFullAttentionSpec": ours.SinkFullAttentionSpec,
    "CrossAttentionSpec": ours.CrossAttentionSpec,
    "MambaSpec": ours.MambaSpec,
}
_CUSTOM: dict[type, Translator] = {}

# vLLM spec classes refused by name, and why (the error says it). A replica of a stored
# layout would serve wrong bytes; a per-request scratch area holds no reusable prefix.
REFUSED: dict[str, str] = {
    "KVCacheSpec": "the abstract base class, not a layer's cache format",
    "AttentionSpec": "the abstract attention base class, not a layer's cache format",
    "EncoderOnlyAttentionSpec": "encoder-only layers keep no KV cache to offload",
    "HiddenStateCacheSpec": "hidden states for extract_hidden_states, not KV: offloading "
                            "them is not modelled",
    "RSWASpec": "R-SWA evicts decode blocks between the prompt and its window, so a stored "
                "block's bytes may be gone",
    "CircularBufferSpec": "a per-request ring buffer of keys still being compressed: no "
                          "prefix determines it, and a hit without it would be wrong",
    "HiSparseHotSpec": "a per-request HiSparse hot cache (no layer views, no prefix)",
    "HiSparseResidentSpec": "HiSparse resident pages are host-backed by vLLM itself",
}
# vLLM spec classes translated (the wrapper of per-layer specs included).
TRANSLATED = frozenset({*_BY_NAME, "UniformTypeKVCacheSpecs"})

# vLLM attention fields whose non-default values change the page format.
_UNSUPPORTED_ATTENTION = {
    "num_head_slots": None,
    "state_content_bytes": None,
    "tokens_per_state": 1,
}


def register_vllm_spec(vllm_spec_cls: type, translate: Translator) -> None:
    """Teach the connector an out-of-tree vLLM spec type: `translate(vllm_spec)` returns
    one of our specs (register its rules with `kv_offload.register_kv_cache_spec`)."""
    _CUSTOM[vllm_spec_cls] = translate


def translate_spec(vllm_spec: Any, where: str) -> KVCacheSpec:
    """Our spec for one vLLM spec; `where` names the layer or group in errors."""
    kind = type(vllm_spec)
    if kind in _CUSTOM:
        return _CUSTOM[kind](vllm_spec)
    if kind.__name__ == "UniformTypeKVCacheSpecs":
        return ours.UniformTypeKVCacheSpecs(
            block_size=vllm_spec.block_size,
            kv_cache_specs={name: translate_spec(spec, f"{where}, layer {name!r}")
                            for name, spec in vllm_spec.kv_cache_specs.items()})
    target = _BY_NAME.get(kind.__name__)
    if kind.__name__ in REFUSED:
        raise ConfigError(
            f"{where}: vLLM KV-cache spec type {kind.__module__}.{kind.__name__} is not "
            f"supported by kv-offload: {REFUSED[kind.__name__]}. Serve this model without "
            "the KV connector, or teach kv-offload the type with "
            "kv_offload.vllm.spec_translation.register_vllm_spec(<its class>, translate)"
        )
    if target is None:
        raise ConfigError(
            f"{where}: vLLM KV-cache spec type {kind.__module__}.{kind.__name__} is not "
            f"supported by kv-offload. Known types: {sorted(_BY_NAME)}. To add it, call "
            "kv_offload.vllm.spec_translation.register_vllm_spec(<its class>, translate) with "
            "a function returning a kv_offload spec whose rules are registered "
            "(kv_offload.register_kv_cache_spec)"
        )
    if issubclass(target, ours.AttentionSpec):
        _refuse_unmodelled(vllm_spec, where)
    values = {f.name: getattr(vllm_spec, f.name) for f in dataclasses.fields(target)
              if hasattr(vllm_spec, f.name)}
    if "mamba_type" in values:
        kind_name = getattr(values["mamba_type"], "name", values["mamba_type"])  # an enum
        values["mamba_type"] = str(kind_name).lower()
    try:
        return target(**values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: cannot translate {kind.__name__}: {err}") from err


def translate_groups(kv_cache_config: Any) -> list[KVCacheGroup]:
    """Our cache groups, in vLLM's group order (group index = vLLM's group id)."""
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        where = f"KV-cache group {index} (layers {list(group.layer_names)[:3]}...)"
        groups.append(KVCacheGroup(list(group.layer_names),
                                   translate_spec(group.kv_cache_spec, where)))
    return groups


def _refuse_unmodelled(vllm_spec: Any, where: str) -> None:
    quant = getattr(vllm_spec, "kv_quant_mode", None)
    if quant is not None and int(quant) != 0:
        raise ConfigError(f"{where}: quantised KV caches (kv_quant_mode={quant!r}) are not "
                          "supported by kv-offload yet")
    for name, default in _UNSUPPORTED_ATTENTION.items():
        value = getattr(vllm_spec, name, default)
        if value != default:
            raise ConfigError(f"{where}: {type(vllm_spec).__name__}.{name}={value!r} (packed "
                              "or compressed pages) is not supported by kv-offload yet")
