"""Allocate kv_caches the way vLLM 0.32 does, without vLLM.

Used by the example models, the tests and the benchmarks, so that everything
downstream is exercised on real engine layouts. Facts (read from vLLM 0.32's
`v1/core/kv_cache_utils.py`, `v1/kv_cache_interface.py`, `v1/worker/utils.py`):
- one int8 backing buffer; every layer is an `as_strided` view into it;
- a placement (vLLM's `KVCacheTensor`) puts layer l's block b at
  `offset + l * layer_stride + b * block_stride`;
- cache groups overlay each other: every group's placements start at byte 0;
- attention layers are 4-D `[B, H, N, C]` views (C = K|V packed, in the spec's
  dtype) whose physical order is the model-wide layout (LBNHC, LBHNC, or the
  block-outer BLNHC / BLHNC that pack all layers inside each block);
- Mamba layers are int8 `[B, 1, 1, real_page]` views whose block stride is the
  padded page;
- kernel blocks: dim 0 holds `num_blocks * ratio` kernel blocks of
  `block_size / ratio` tokens, possible only when a block is one dense page.
Legacy layouts (split K/V, Mamba as a list of state tensors) are built by the
`legacy_*` functions at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import torch

from kv_offload.specs import (
    AttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)

# Physical order of the logical axes [L, B, H, N, C], outermost first.
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
}
_H, _N, _C = 2, 3, 4


@dataclass(frozen=True)
class Placement:
    """Where a run of same-spec layers of one group lives (vLLM's KVCacheTensor)."""

    layers: tuple[str, ...]
    spec: KVCacheSpec
    layer_stride: int
    block_stride: int
    offset: int


def _layer_specs(group: KVCacheGroup) -> list[tuple[KVCacheSpec, list[str]]]:
    """Consecutive layers of a group bucketed by their spec, first-seen order."""
    buckets: dict[KVCacheSpec, list[str]] = {}
    for name in group.layer_names:
        buckets.setdefault(group.layer_spec(name), []).append(name)
    return list(buckets.items())


def plan_placements(
    groups: Sequence[KVCacheGroup], num_blocks: int, layout: str = "LBNHC"
) -> tuple[int, list[Placement]]:
    """The backing size in bytes and every group's placements."""
    block_outer = LAYOUTS[layout][0] == 1
    bytes_per_block = max(
        sum(spec.page_size_bytes * len(names) for spec, names in _layer_specs(g)) for g in groups
    )
    placements = []
    for group in groups:
        offset = 0  # groups overlay: each starts at byte 0
        for spec, names in _layer_specs(group):
            page = spec.page_size_bytes
            if block_outer:
                block_stride, layer_stride = bytes_per_block, page
            else:
                block_stride, layer_stride = page, page * num_blocks
            placements.append(Placement(tuple(names), spec, layer_stride, block_stride, offset))
            offset += len(names) * layer_stride
    return bytes_per_block * num_blocks, placements


def _page_shape_and_strides(
    spec: KVCacheSpec, layout: str, tokens: int
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """[H, N, C] (C in bytes) of one kernel block and their byte strides."""
    if isinstance(spec, MambaSpec):
        return (1, 1, spec.real_page_size_bytes), (1, 1, 1)
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"cannot allocate a layer of {type(spec).__name__}")
    item = spec.dtype.itemsize
    shape = {_H: spec.num_kv_heads, _N: tokens, _C: (spec.head_size + spec.head_size_v) * item}
    strides, step = {}, 1
    for axis in reversed(LAYOUTS[layout][2:]):
        strides[axis] = step
        step *= shape[axis]
    return (shape[_H], shape[_N], shape[_C]), (strides[_H], strides[_N], strides[_C])


def allocate_kv_caches(
    groups: Sequence[KVCacheGroup],
    num_blocks: int,
    layout: str = "LBNHC",
    kernel_block_sizes: Sequence[int | None] | None = None,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One int8 buffer and a per-layer view for every layer of every group."""
    size, placements = plan_placements(groups, num_blocks, layout)
    buffer = torch.zeros(size, dtype=torch.int8, device=device)
    block_outer = LAYOUTS[layout][0] == 1
    kernel_of = {}
    for g, group in enumerate(groups):
        # vLLM never splits the blocks of a block-outer layout (other layers sit between them).
        kernel = kernel_block_sizes[g] if kernel_block_sizes and not block_outer else None
        kernel_of.update((name, kernel) for name in group.layer_names)
    caches: dict[str, torch.Tensor] = {}
    for p in placements:
        tokens = p.spec.block_size
        if kernel_of[p.layers[0]] and not isinstance(p.spec, MambaSpec):  # Mamba never splits
            tokens = kernel_of[p.layers[0]]
            if p.spec.block_size % tokens:
                raise ValueError(f"{p.layers[0]}: kernel block size {tokens} does not divide "
                                 f"block size {p.spec.block_size}")
        ratio = p.spec.block_size // tokens
        shape, strides = _page_shape_and_strides(p.spec, layout, tokens)
        block_stride = p.block_stride
        if ratio > 1:
            if block_stride != p.spec.real_page_size_bytes:
                raise ValueError(f"{p.layers[0]}: kernel blocks need dense, unpadded pages")
            block_stride //= ratio
        for index, name in enumerate(p.layers):
            view = buffer.as_strided(
                (num_blocks * ratio, *shape), (block_stride, *strides),
                p.offset + index * p.layer_stride,
            )
            if isinstance(p.spec, AttentionSpec):
                view = view.view(p.spec.dtype)
            caches[name] = view
    return buffer, caches


def legacy_split_kv(
    spec: AttentionSpec, num_blocks: int, num_layers: int, kv_outer: bool = True
) -> dict[str, torch.Tensor]:
    """Older engines: one tensor per layer, `(2, nb, bs, H, D)` if `kv_outer`
    else `(nb, 2, bs, H, D)`."""
    dims = (spec.block_size, spec.num_kv_heads, spec.head_size)
    shape = (2, num_blocks, *dims) if kv_outer else (num_blocks, 2, *dims)
    return {f"layers.{i}.attn": torch.zeros(shape, dtype=spec.dtype) for i in range(num_layers)}


def legacy_mamba_states(
    spec: MambaSpec, num_blocks: int, num_layers: int
) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """Older engines: per Mamba layer a list of state tensors (conv, ssm, ...),
    views packed back to back into one padded page per block."""
    page = spec.page_size_bytes
    buffer = torch.zeros(num_layers * num_blocks * page, dtype=torch.int8)
    caches = {}
    for layer in range(num_layers):
        start = layer * num_blocks * page
        states = []
        for shape, dtype in zip(spec.shapes, spec.dtypes):
            item = dtype.itemsize
            if start % item or page % item:
                raise ValueError("state offsets must be aligned to the state dtype")
            region = buffer[start:].view(dtype)
            states.append(region.as_strided((num_blocks, *shape), (page // item, *_dense(shape))))
            start += item * prod(shape)
        caches[f"layers.{layer}.mamba"] = states
    return buffer, caches


def _dense(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def uniform_group(block_size: int, layer_specs: dict[str, KVCacheSpec]) -> KVCacheGroup:
    """A group whose layers share a spec type but not sizes."""
    return KVCacheGroup(list(layer_specs), UniformTypeKVCacheSpecs(block_size, layer_specs))
