"""Byte mapping between a rank's engine pages and TP-free head units (see `tp.layout`).

A rank's page of one attention layer for one manager block, as the canonical view holds it
(`CanonicalRef`: `page_size_bytes` real bytes at `offset_bytes`), is vLLM 0.32's 4-D cache
`[kernel blocks, H, n, K|V]` cut at one manager block: `ratio = block_size / n` kernel pages
back to back, each `[H, n, row]` (LBHNC / BLHNC, "HND") or `[n, H, row]` (LBNHC / BLNHC,
"NHD"), where `row = (head_size + head_size_v) * dtype size` bytes and H is this rank's head
count. `page_format` reads that order from the engine tensor's own strides (never from a
layout name), so what we map is what the engine allocated.

A unit (one global KV head `g` of one block of one group) is, for every layer of the group in
the canonical view's ref order, head `g`'s `block_size` rows, token-major: independent of H,
of the head order and of `n`. `GroupUnits.split` cuts a block's pages into the units this rank
writes; `GroupUnits.assemble` writes units into a block's pages at the rank's local head
positions, after `missing` has found every unit it needs (a rank never loads part of a block).

Only raw bytes move: no dtype conversion, so a value round-trips bit for bit (NaN payloads
too). Legacy split-K/V caches (`(2, nb, bs, H, D)`) are not mapped (`CanonicalizationError`):
those groups stay per TP shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kv_offload.canonical import CanonicalKVCaches
from kv_offload.errors import CanonicalizationError, TransferError
from kv_offload.specs import AttentionSpec, KVCacheGroup, dtype_size
from kv_offload.store.tp.layout import KVHeadShard


@dataclass(frozen=True)
class AttentionPageFormat:
    """The byte order of one layer's page for one manager block on one rank."""

    num_heads: int  # heads on this rank (the page's head axis)
    block_tokens: int
    kernel_tokens: int  # tokens per kernel block (== block_tokens when blocks are not split)
    row_bytes: int  # one token of one head: K then V
    heads_outer: bool  # kernel page [H, n, row] (True) or [n, H, row] (False)

    @property
    def page_bytes(self) -> int:
        return self.num_heads * self.block_tokens * self.row_bytes

    @property
    def unit_bytes(self) -> int:
        """Bytes of one head of this layer in a unit."""
        return self.block_tokens * self.row_bytes

    def head_view(self, page: torch.Tensor) -> torch.Tensor:
        """`(H, ratio, n, row)` int8 view of a dense 1-D int8 page (no copy)."""
        if page.dtype != torch.int8 or page.dim() != 1 or page.numel() != self.page_bytes:
            raise TransferError(f"a page of {self.page_bytes} int8 bytes was expected, got "
                                f"{page.dtype} {tuple(page.shape)}")
        ratio, n = self.block_tokens // self.kernel_tokens, self.kernel_tokens
        if self.heads_outer:
            return page.view(ratio, self.num_heads, n, self.row_bytes).permute(1, 0, 2, 3)
        return page.view(ratio, n, self.num_heads, self.row_bytes).permute(2, 0, 1, 3)


def page_format(name: str, cache: torch.Tensor, spec: AttentionSpec,
                num_blocks: int) -> AttentionPageFormat:
    """The page format of a vLLM 0.32 attention cache `[kernel blocks, H, n, K|V]`,
    proven from its shape and strides; CanonicalizationError for anything else."""
    row = spec.head_size + spec.head_size_v
    where = f"layer {name!r} (shape {tuple(cache.shape)}, strides {cache.stride()})"
    if cache.dim() != 4 or cache.shape[1] != spec.num_kv_heads or cache.shape[3] != row:
        raise CanonicalizationError(f"{where}: expected [blocks, {spec.num_kv_heads} heads, "
                                    f"tokens, {row}] for a head-unit mapping")
    blocks, heads, n, _ = cache.shape
    if blocks % num_blocks or n * (blocks // num_blocks) != spec.block_size:
        raise CanonicalizationError(f"{where}: {blocks} kernel blocks of {n} tokens do not "
                                    f"make {num_blocks} blocks of {spec.block_size} tokens")
    s_heads, s_tokens, s_row = cache.stride()[1:]
    heads_outer_ok = s_row == 1 and (n == 1 or s_tokens == row) and \
        (heads == 1 or s_heads == n * row)
    tokens_outer_ok = s_row == 1 and (heads == 1 or s_heads == row) and \
        (n == 1 or s_tokens == heads * row)
    if not (heads_outer_ok or tokens_outer_ok):
        raise CanonicalizationError(f"{where}: a kernel page is neither [heads, tokens, row] "
                                    f"nor [tokens, heads, row] dense")
    return AttentionPageFormat(heads, spec.block_size, n, row * dtype_size(spec.dtype),
                               heads_outer_ok)


@dataclass(frozen=True)
class GroupUnits:
    """The units of one cache group on one rank: per layer (canonical ref order) its page
    format, and which heads the rank holds."""

    formats: tuple[AttentionPageFormat, ...]
    shard: KVHeadShard

    def __post_init__(self) -> None:
        for fmt in self.formats:
            if fmt.num_heads != self.shard.num_heads:
                raise CanonicalizationError(f"a page of {fmt.num_heads} heads on a rank that "
                                            f"holds {self.shard.num_heads}")

    @property
    def unit_bytes(self) -> int:
        return sum(fmt.unit_bytes for fmt in self.formats)

    def split(self, pages: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The units this rank writes (global head -> int8 bytes) from one block's pages."""
        views = self._views(pages)
        units = {}
        for head in self.shard.units_written():
            local = head - self.shard.first_head
            # (reshape copies here: a head's rows are strided inside an NHD page)
            units[head] = torch.cat([view[local].reshape(-1) for view in views])
        return units

    def missing(self, units: Mapping[int, torch.Tensor]) -> list[int]:
        """The units this rank needs that `units` lacks (empty: the block can load)."""
        return [head for head in self.shard.units_needed() if head not in units]

    def assemble(self, units: Mapping[int, torch.Tensor], pages: Sequence[torch.Tensor]) -> None:
        """Write this rank's heads from `units` into one block's pages."""
        if lacking := self.missing(units):
            raise TransferError(f"units {lacking} of this block are missing; load none of it")
        views = self._views(pages)
        for head in self.shard.units_needed():
            unit = units[head]
            if unit.dtype != torch.int8 or unit.numel() != self.unit_bytes:
                raise TransferError(f"unit {head}: {unit.numel()} bytes of {unit.dtype}, "
                                    f"expected {self.unit_bytes} int8 bytes")
            local, start = head - self.shard.first_head, 0
            for fmt, view in zip(self.formats, views):
                part = unit[start:start + fmt.unit_bytes]
                view[local].copy_(part.view(view[local].shape))
                start += fmt.unit_bytes

    def _views(self, pages: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(pages) != len(self.formats):
            raise TransferError(f"{len(pages)} pages for a group of {len(self.formats)} layers")
        return [fmt.head_view(page) for fmt, page in zip(self.formats, pages)]


def group_units(canonical: CanonicalKVCaches, kv_caches: Mapping[str, torch.Tensor],
                group_index: int, group: KVCacheGroup, shard: KVHeadShard) -> GroupUnits:
    """The `GroupUnits` of a group from its canonical refs and the engine tensors."""
    formats = []
    for ref in canonical.group_refs[group_index]:
        spec = group.layer_spec(ref.layer_name)
        if not isinstance(spec, AttentionSpec):
            raise CanonicalizationError(f"layer {ref.layer_name!r}: {type(spec).__name__} "
                                        f"has no heads to map")
        fmt = page_format(ref.layer_name, kv_caches[ref.layer_name], spec, canonical.num_blocks)
        if fmt.page_bytes != ref.page_size_bytes:
            raise CanonicalizationError(f"layer {ref.layer_name!r}: its canonical page holds "
                                        f"{ref.page_size_bytes} bytes, {fmt.page_bytes} mapped")
        formats.append(fmt)
    return GroupUnits(tuple(formats), shard)


def group_block_pages(canonical: CanonicalKVCaches, group_index: int,
                      block: int) -> list[torch.Tensor]:
    """Views of one engine block's pages of a group, in canonical ref order (no copy)."""
    return [
        canonical.tensors[ref.tensor_idx].tensor[block, ref.offset_bytes:
                                                 ref.offset_bytes + ref.page_size_bytes]
        for ref in canonical.group_refs[group_index]
    ]
