"""Built-in example models: realistic layer specs, allocated the way vLLM 0.32 does.

They feed the tests, `kv-offload inspect` and the benchmarks. Sizes follow the
public model configs; `num_blocks` scales the allocation. Hybrid models are
grouped with vLLM's rule (layers bucketed by mergeable spec, split into
groups of equal size) and hybrid page sizes are unified the way vLLM does it:
the attention block grows until its page covers the Mamba state, and the
Mamba page is padded up to the attention page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_offload.errors import SpecMergeError
from kv_offload.specs import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kv_offload.testing.engine_alloc import allocate_kv_caches


@dataclass(frozen=True)
class ExampleModel:
    name: str
    kv_caches: dict[str, torch.Tensor]
    groups: list[KVCacheGroup]
    num_blocks: int
    buffer: torch.Tensor
    layout: str


def group_layers(layer_specs: dict[str, KVCacheSpec]) -> list[KVCacheGroup]:
    """vLLM's grouping for uniform page sizes: bucket layers whose specs merge,
    then cut every bucket into groups of the smallest bucket's size (or the
    largest one's when they differ by less than 1.5x)."""
    buckets: list[tuple[list[str], list[KVCacheSpec]]] = []
    for name, spec in layer_specs.items():
        for names, specs in buckets:
            try:
                type(specs[0]).merge([*specs, spec])
            except SpecMergeError:
                continue
            names.append(name)
            specs.append(spec)
            break
        else:
            buckets.append(([name], [spec]))
    sizes = [len(names) for names, _ in buckets]
    size = max(sizes) if max(sizes) < 1.5 * min(sizes) else min(sizes)
    return [
        KVCacheGroup(names[i:i + size], type(specs[0]).merge(specs))
        for names, specs in buckets
        for i in range(0, len(names), size)
    ]


def kv_heads_per_rank(total: int, tp_size: int) -> int:
    """vLLM's rule (`ModelConfig.get_num_kv_heads`): split, or one replicated head."""
    return max(1, total // tp_size)


def llama_8b(tp_size: int = 1) -> dict[str, KVCacheSpec]:
    """Llama-3-8B: 32 layers, 8 KV heads of 128, bf16, 16-token blocks (64 KiB pages)."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=kv_heads_per_rank(8, tp_size),
                             head_size=128, dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(32)}


def gemma3(tp_size: int = 1) -> dict[str, KVCacheSpec]:
    """Gemma-3-12B: 48 layers, every 6th global, the rest a 1024-token window;
    8 KV heads of 256, bf16 (128 KiB pages)."""
    common = dict(block_size=16, num_kv_heads=kv_heads_per_rank(8, tp_size), head_size=256,
                  dtype=torch.bfloat16)
    full = FullAttentionSpec(**common)
    local = SlidingWindowSpec(sliding_window=1024, **common)
    return {f"model.layers.{i}.self_attn.attn": full if i % 6 == 5 else local for i in range(48)}


def qwen3_next(tp_size: int = 1) -> dict[str, KVCacheSpec]:
    """Qwen3-Next-80B-A3B: 48 layers, every 4th gated attention (2 KV heads of
    256, bf16), the rest Gated DeltaNet with a conv state (3 x 8192) and an SSM
    state (32 x 128 x 128), bf16. The attention block grows to a multiple of 32
    tokens whose page covers the state; the state page is padded to match.
    Per rank (`tp_size`) the conv channels and SSM heads are split and the KV heads
    split or replicated, so the unified block size depends on the TP size."""
    conv, ssm = (3, 8192 // tp_size), (32 // tp_size, 128, 128)
    state = MambaSpec(block_size=1, shapes=(conv, ssm), dtypes=(torch.bfloat16,) * 2)
    heads = kv_heads_per_rank(2, tp_size)
    per_token = heads * (256 + 256) * 2
    block = -(-state.real_page_size_bytes // (per_token * 32)) * 32
    attn = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=256,
                             dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=block, shapes=state.shapes, dtypes=state.dtypes,
                      page_size_padded=attn.page_size_bytes)
    return {
        (f"model.layers.{i}.self_attn.attn" if i % 4 == 3 else f"model.layers.{i}.linear_attn"):
            attn if i % 4 == 3 else mamba
        for i in range(48)
    }


def deepseek_mla(tp_size: int = 1) -> dict[str, KVCacheSpec]:
    """DeepSeek-V3: 61 MLA layers, one 576-wide latent (512 + 64 rope) per token,
    bf16, 64-token blocks; the latent is replicated on every rank (any `tp_size`)."""
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(61)}


# Layer specs of one rank at a TP size (default 1: the whole model).
EXAMPLE_MODELS: dict[str, Callable[..., dict[str, KVCacheSpec]]] = {
    "llama-8b": llama_8b,
    "gemma3": gemma3,
    "qwen3-next": qwen3_next,
    "deepseek-mla": deepseek_mla,
}

# The model's KV-head count (before tensor parallelism; MLA: one latent).
TOTAL_KV_HEADS: dict[str, int] = {"llama-8b": 8, "gemma3": 8, "qwen3-next": 2, "deepseek-mla": 1}

# Kernel block size per model when the attention backend splits blocks.
KERNEL_BLOCK_SIZES: dict[str, int] = {"qwen3-next": 32}


def build_example(
    name: str,
    num_blocks: int,
    *,
    layout: str = "LBNHC",
    kernel_block_size: int | None = None,
    device: str | torch.device = "cpu",
    tp_size: int = 1,
) -> ExampleModel:
    """Allocate an example model's kv_caches exactly as vLLM 0.32 would.

    `kernel_block_size` (default: the model's entry in KERNEL_BLOCK_SIZES) splits
    attention blocks into kernel blocks; Mamba groups are never split. `device="meta"`
    gives the shapes and strides without memory (benchmarks of address planning).
    `tp_size` > 1 gives the cache of one rank of that tensor-parallel size."""
    if name not in EXAMPLE_MODELS:
        raise KeyError(f"unknown example model {name!r}; choose from {sorted(EXAMPLE_MODELS)}")
    groups = group_layers(EXAMPLE_MODELS[name](tp_size))
    kernel = kernel_block_size or KERNEL_BLOCK_SIZES.get(name)
    kernels = [None if isinstance(g.spec, MambaSpec) else kernel for g in groups]
    buffer, caches = allocate_kv_caches(groups, num_blocks, layout, kernels, device)
    return ExampleModel(name, caches, groups, num_blocks, buffer, layout)
