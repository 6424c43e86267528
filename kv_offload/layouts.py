"""Layout rules: where one layer keeps its bytes for each manager block.

A rule turns a layer's engine cache (any dtype, shape and strides) into one or
more `LayerPages`: a contiguous run of bytes per block at a fixed stride. The
order of bytes *inside* a page does not matter for offloading (we move raw
bytes), so a rule only has to prove that each block's bytes form one dense run
of exactly the size the spec says, with no overlap between blocks. Anything it
cannot prove raises `CanonicalizationError` naming the layer, shape, strides,
dtype and spec.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kv_offload.errors import CanonicalizationError
from kv_offload.specs import AttentionSpec, KVCacheSpec, MambaSpec, dtype_size

CacheInput = torch.Tensor | Sequence[torch.Tensor]


@dataclass(frozen=True)
class LayerPages:
    """One layer's bytes for every manager block: block b's data are the
    `nbytes` bytes starting `offset + b * block_stride` bytes into `source`'s
    storage; the page occupies `slot_bytes` (>= nbytes when padded)."""

    source: torch.Tensor
    offset: int
    block_stride: int
    nbytes: int
    slot_bytes: int

    @property
    def address(self) -> int:
        """Absolute address of block 0's first byte (for overlap checks)."""
        return self.source.untyped_storage().data_ptr() + self.offset


LayoutRule = Callable[[str, CacheInput, KVCacheSpec, int], list[LayerPages]]


def describe(cache: CacheInput) -> str:
    """Shape, strides and dtype of a cache for error messages."""
    if isinstance(cache, torch.Tensor):
        return f"shape {tuple(cache.shape)}, strides {cache.stride()}, dtype {cache.dtype}"
    return "[" + "; ".join(describe(t) for t in cache) + "]"


def fail(name: str, cache: CacheInput, spec: KVCacheSpec, why: str) -> CanonicalizationError:
    return CanonicalizationError(f"layer {name!r} ({describe(cache)}) with {spec}: {why}")


def dense_bytes(tensor: torch.Tensor, dims: Sequence[int]) -> int | None:
    """Bytes covered by `dims` if they tile a contiguous run exactly (in any
    order of strides), else None."""
    item = tensor.element_size()
    expected = item
    for dim in sorted((d for d in dims if tensor.shape[d] != 1), key=tensor.stride):
        if tensor.stride(dim) * item != expected:
            return None
        expected *= tensor.shape[dim]
    return expected


def block_pages(
    name: str,
    tensor: torch.Tensor,
    spec: KVCacheSpec,
    num_blocks: int,
    expected_bytes: int,
    whole: CacheInput | None = None,
) -> tuple[int, int]:
    """Prove that dim 0 of `tensor` indexes blocks (`num_blocks * ratio` kernel
    blocks allowed) and that each manager block is one dense run of
    `expected_bytes`. Returns (offset of block 0, manager block stride) in bytes."""
    whole = tensor if whole is None else whole
    if tensor.dim() < 1 or tensor.shape[0] % num_blocks:
        raise fail(name, whole, spec, f"dim 0 must hold {num_blocks} blocks (or a multiple "
                   f"of it as kernel blocks), got {tuple(tensor.shape)}")
    ratio = tensor.shape[0] // num_blocks
    item = tensor.element_size()
    kernel_page = dense_bytes(tensor, range(1, tensor.dim()))
    if kernel_page is None:
        raise fail(name, whole, spec, "the bytes of one block are not one dense run (is the "
                   "layout head-outer, e.g. LHBNC? use a block-compact layout such as LBNHC)")
    if kernel_page * ratio != expected_bytes:
        raise fail(name, whole, spec, f"one block holds {kernel_page * ratio} bytes "
                   f"({ratio} x {kernel_page}), the spec says {expected_bytes}")
    kernel_stride = tensor.stride(0) * item
    if ratio > 1 and kernel_stride != kernel_page:
        raise fail(name, whole, spec, f"{ratio} kernel blocks per block are not adjacent "
                   f"(kernel block stride {kernel_stride} != kernel page {kernel_page})")
    stride = kernel_stride * ratio
    if num_blocks > 1 and stride < expected_bytes:
        raise fail(name, whole, spec, f"blocks overlap: block stride {stride} bytes is "
                   f"smaller than the {expected_bytes}-byte page")
    return tensor.storage_offset() * item, stride


def _single_tensor(name: str, cache: CacheInput, spec: KVCacheSpec) -> torch.Tensor:
    if not isinstance(cache, torch.Tensor):
        raise fail(name, cache, spec, "expected one tensor for this layer, got a list")
    return cache


def attention_layout(
    name: str, cache: CacheInput, spec: KVCacheSpec, num_blocks: int
) -> list[LayerPages]:
    """Attention (and MLA) caches: packed `[blocks, ...]` with K and V inside each
    page (vLLM 0.32 `[B, H, N, K|V]`, legacy `(nb, 2, bs, H, D)`, MLA latents), or
    legacy split `(2, nb, bs, H, D)`, which becomes two pages: K and V."""
    if not isinstance(spec, AttentionSpec):
        raise fail(name, cache, spec, "attention_layout needs an AttentionSpec")
    tensor = _single_tensor(name, cache, spec)
    real, slot = spec.real_page_size_bytes, spec.page_size_bytes
    k_bytes = spec.block_size * spec.num_kv_heads * spec.head_size * dtype_size(spec.dtype)
    v_bytes = real - k_bytes
    candidates: list[list[LayerPages]] = []
    errors: list[str] = []
    try:
        offset, stride = block_pages(name, tensor, spec, num_blocks, real)
        candidates.append([LayerPages(tensor, offset, stride, real, slot)])
    except CanonicalizationError as exc:
        errors.append(str(exc))
    if tensor.dim() == 5 and tensor.shape[0] == 2 and v_bytes > 0:
        try:
            parts = []
            for half, nbytes in ((tensor[0], k_bytes), (tensor[1], v_bytes)):
                offset, stride = block_pages(name, half, spec, num_blocks, nbytes, tensor)
                # The padded slot is split like the data: K's share, then V's.
                share = slot * nbytes // real
                parts.append(LayerPages(tensor, offset, stride, nbytes, share))
            candidates.append(parts)
        except CanonicalizationError as exc:
            errors.append(str(exc))
    if len(candidates) == 2 and _same_runs(candidates[0], candidates[1], num_blocks):
        candidates.pop()  # e.g. one block: "K then V" is the packed page itself
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise CanonicalizationError(" / ".join(errors))
    raise fail(name, cache, spec, "ambiguous: dim 0 could be the K/V split or the block "
               "index (num_blocks == 2?); refusing to guess")


def _same_runs(packed: list[LayerPages], split: list[LayerPages], num_blocks: int) -> bool:
    """Whether split K/V pages cover exactly the bytes of the packed page."""
    (page,), (k, v) = packed, split
    same_stride = num_blocks == 1 or page.block_stride == k.block_stride == v.block_stride
    return k.offset == page.offset and v.offset == k.offset + k.nbytes and same_stride


def mamba_layout(
    name: str, cache: CacheInput, spec: KVCacheSpec, num_blocks: int
) -> list[LayerPages]:
    """Mamba state: vLLM 0.32 int8 pages `[nb, 1, 1, real]` whose stride is the
    padded page, or a list of state tensors (conv, ssm, ...) that are views of
    one page, packed back to back."""
    if not isinstance(spec, MambaSpec):
        raise fail(name, cache, spec, "mamba_layout needs a MambaSpec")
    real, slot = spec.real_page_size_bytes, spec.page_size_bytes
    if isinstance(cache, torch.Tensor):
        offset, stride = block_pages(name, cache, spec, num_blocks, real)
        return [LayerPages(cache, offset, stride, real, slot)]
    states = list(cache)
    sizes = spec.state_sizes_bytes
    if len(states) != len(sizes) or not states:
        raise fail(name, cache, spec, f"expected {len(sizes)} state tensors, got {len(states)}")
    storage = states[0].untyped_storage().data_ptr()
    runs = []
    for state, nbytes in zip(states, sizes):
        if state.untyped_storage().data_ptr() != storage:
            raise fail(name, cache, spec, "state tensors live in different allocations")
        if state.shape[0] != num_blocks:
            raise fail(name, cache, spec, "Mamba state tensors cannot hold kernel blocks")
        runs.append((*block_pages(name, state, spec, num_blocks, nbytes, cache), nbytes))
    strides = {stride for _, stride, _ in runs}
    if len(strides) != 1:
        raise fail(name, cache, spec, f"state tensors have different block strides {strides}")
    runs.sort()
    for (offset, _, nbytes), (next_offset, _, _) in zip(runs, runs[1:]):
        if offset + nbytes != next_offset:
            raise fail(name, cache, spec, "state tensors are not packed back to back in "
                       f"one page (gap or overlap at byte {offset + nbytes - runs[0][0]})")
    return [LayerPages(states[0], runs[0][0], strides.pop(), real, slot)]

