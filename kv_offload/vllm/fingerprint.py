"""What must match for stored KV to be served: the fingerprint's engine part.

Stored bytes are served only under the same layout fingerprint (`tiering.layout_fingerprint`:
page sizes of the canonical view, plus the string built here). It holds what decides the
bytes and the keys, and nothing else, so a cache survives what does not change them:

- **The model's bytes.** The Hugging Face config (hashed), dtype, quantization, every cache
  group's spec, the cache dtypes and layout, and the weights' identity
  (`kv_offload.vllm.weights`: every byte of the weight files, or `model_identity`): weights
  edited in place under the same path and config are a new model. With the weights
  identified, the model's path is left out: servers that keep the same weights under
  different paths share one cache.
- **The keys.** vLLM keys blocks by a chain of hashes. Rather than vLLM's version (which
  made every entry miss after any upgrade although hashes and pages were unchanged), a
  canary: two fixed blocks hashed with the engine's own block-hash function, hash algorithm
  and seed (`hash_scheme_canary`). A vLLM that hashes blocks differently gives another
  canary: a miss, never wrong bytes. Where vLLM's hashing functions cannot be found (a
  future vLLM moved them), the version is used instead.
- **The shard.** Tensor and pipeline parallel sizes and this rank decide which heads and
  layers a page holds: they are part of a rank's own fingerprint (per-shape groups), while
  TP-free records (`kv_offload.store.tp.records`) are namespaced by the same identity without the
  TP size, the TP rank, the per-rank specs and the page layout (records hold whole heads in
  an order of their own), keeping the pipeline stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from kv_offload.store.tp.records import TPShare
from kv_offload.vllm.weights import WeightsIdentity

logger = logging.getLogger(__name__)

CANARY_TOKENS = 64  # per canary block (any fixed count: the tokens are only hashed)


@dataclass(frozen=True)
class EngineFingerprint:
    """`shape`: the engine part of a rank's own layout fingerprint (everything, TP size and
    rank included: per-shape groups and the host tier). `share`: what the rank needs to
    read and write TP-free records (`kv_offload.store.tp.records`), whose namespace leaves out
    the TP size, the TP rank, the per-rank specs and the page layout."""

    shape: str
    share: TPShare


def fingerprint_extra(vllm_config: Any, kv_cache_config: Any, groups: list,
                      rank: int, weights: WeightsIdentity | None) -> EngineFingerprint:
    """The engine parts of the layout fingerprints (see the module docstring); ``weights``:
    `kv_offload.vllm.weights`'s identity (None: the model's name and revision instead)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel = vllm_config.parallel_config
    hf_config = xxhash.xxh3_64_hexdigest(model.hf_config.to_json_string().encode())
    tp_size = parallel.tensor_parallel_size
    common = (f"weights:{weights.digest}" if weights else f"model:{model.model}@{model.revision}",
              hf_config, model.dtype, model.quantization, cache.cache_dtype,
              cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype,
              f"keys:{hash_scheme_canary(cache.prefix_caching_hash_algo)}",
              kv_cache_config.hash_block_size)
    shape = "|".join(str(part) for part in (
        *common, [repr(group.spec) for group in groups], kv_cache_config.kv_cache_layout,
        f"tp{tp_size}", f"pp{parallel.pipeline_parallel_size}", f"rank{rank}"))
    # Pipeline stages hold other layers: the stage stays in the shared part.
    shared = "|".join(str(part) for part in (
        *common, f"pp{parallel.pipeline_parallel_size}", f"stage{rank // tp_size}"))
    return EngineFingerprint(shape, TPShare(shared, tp_size, rank % tp_size,
                                            model.get_total_num_kv_heads()))


def hash_scheme_canary(hash_algo: str, *, hash_block_tokens: Callable | None = None) -> str:
    """A digest of two fixed blocks as the engine keys them (vLLM's own hash function for
    `hash_algo`, its seed and its chaining); `hash_block_tokens` replaces vLLM's chaining
    function (tests). Falls back to vLLM's version if those functions are not found."""
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils

        hash_fn = get_hash_fn_by_name(hash_algo)
        # The first parent hash: the engine's own if it set it in this process, else derived
        # as vLLM derives it (PYTHONHASHSEED, else a fixed default for cryptographic hashes,
        # else random: per-process keys then never match another process's anyway). Never
        # `init_none_hash`: that would re-seed the engine's own hashes.
        root = getattr(kv_cache_utils, "NONE_HASH", None) or \
            hash_fn(kv_cache_utils.resolve_none_hash_seed(hash_fn))
        chain = hash_block_tokens or kv_cache_utils.hash_block_tokens
    except (ImportError, AttributeError, ValueError) as exc:
        import vllm

        logger.info("kv-offload: vLLM's block hashing not found (%s); keying the cache on "
                    "vLLM %s instead", exc, vllm.__version__)
        return f"vllm{vllm.__version__}"
    first = chain(hash_fn, root, list(range(CANARY_TOKENS)), None)
    second = chain(hash_fn, first, list(range(CANARY_TOKENS, 2 * CANARY_TOKENS)), None)
    return xxhash.xxh3_64_hexdigest(bytes(first) + bytes(second))
