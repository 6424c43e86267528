"""canonicalize(): engine KV caches in any layout -> CanonicalKVCaches.

The canonical view is a list of *unique* int8 tensors shaped
`(num_blocks, page_size_bytes)`, each a view (never a copy) of engine memory,
plus per cache group one ref per layer: which tensor, where in its page the
layer's bytes start, and how many carry data. Everything downstream (kernels,
backends, the connector) sees only this view.

How: each layer's registered layout rule says where its bytes live per block
(`LayerPages`). Pages of different layers that overlap at the same block
stride (cache groups overlay each other; shared-KV layers alias) are merged
into one canonical tensor with refs from every group. Anything else that
overlaps, or runs past its allocation, is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kv_offload.errors import CanonicalizationError
from kv_offload.layouts import CacheInput, LayerPages, describe
from kv_offload.registry import KVCacheSpecRegistry, default_registry
from kv_offload.specs import KVCacheGroup


@dataclass(frozen=True)
class CanonicalTensor:
    """An int8 `(num_blocks, page_size_bytes)` view of engine memory."""

    tensor: torch.Tensor
    page_size_bytes: int
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class CanonicalRef:
    """One layer of one group: `page_size_bytes` bytes of data at `offset_bytes`
    inside each page of tensor `tensor_idx`; a host slot reserves `slot_bytes`."""

    tensor_idx: int
    page_size_bytes: int
    offset_bytes: int = 0
    slot_bytes: int = 0
    layer_name: str = ""

    def __post_init__(self) -> None:
        if self.slot_bytes < self.page_size_bytes:
            object.__setattr__(self, "slot_bytes", self.page_size_bytes)


@dataclass(frozen=True)
class CanonicalKVCaches:
    tensors: list[CanonicalTensor]
    group_refs: list[list[CanonicalRef]]
    num_blocks: int

    def data_bytes_per_block(self, group: int) -> int:
        """Bytes of data one block of `group` holds across all its layers."""
        return sum(ref.page_size_bytes for ref in self.group_refs[group])

    def slot_bytes_per_block(self, group: int) -> int:
        """Bytes a host slot for one block of `group` reserves (padding included)."""
        return sum(ref.slot_bytes for ref in self.group_refs[group])

    def layout_signature(self) -> list[list[tuple[int, int, int, int]]]:
        """Address-free description of the layout (per group, per ref: tensor page
        size, offset, data bytes, slot bytes): equal signatures mean a page stored
        from one engine fits another."""
        return [
            [
                (self.tensors[r.tensor_idx].page_size_bytes, r.offset_bytes,
                 r.page_size_bytes, r.slot_bytes)
                for r in refs
            ]
            for refs in self.group_refs
        ]


@dataclass
class _Member:
    group: int
    layer: str
    pages: LayerPages


@dataclass
class _Cluster:
    """Pages at one block stride whose bytes overlap: one canonical tensor."""

    start: int  # absolute address of block 0
    stride: int
    width: int
    members: list[_Member] = field(default_factory=list)

    def extent_end(self, num_blocks: int) -> int:
        return self.start + (num_blocks - 1) * self.stride + self.width


def canonicalize(
    kv_caches: Mapping[str, CacheInput],
    groups: Sequence[KVCacheGroup],
    num_blocks: int,
    *,
    registry: KVCacheSpecRegistry | None = None,
) -> CanonicalKVCaches:
    """Build the canonical view of `kv_caches` for these cache groups."""
    registry = registry or default_registry
    if not isinstance(num_blocks, int) or num_blocks <= 0:
        raise CanonicalizationError(f"num_blocks must be a positive int, got {num_blocks!r}")
    registry.check(groups)
    members = []
    for g, group in enumerate(groups):
        for name in group.layer_names:
            cache = _layer_cache(kv_caches, name, g)
            spec = group.layer_spec(name)
            for pages in registry.rules_for(spec).layout(name, cache, spec, num_blocks):
                _check_bounds(name, cache, pages, num_blocks)
                members.append(_Member(g, name, pages))
    _check_aliases(kv_caches, groups)
    clusters = _cluster(members, num_blocks)
    _check_disjoint(clusters, num_blocks)
    return _build(clusters, groups, num_blocks)


def _layer_cache(kv_caches: Mapping[str, CacheInput], name: str, group: int) -> CacheInput:
    try:
        return kv_caches[name]
    except KeyError:
        known = sorted(kv_caches)
        shown = known[:8] + (["..."] if len(known) > 8 else [])
        raise CanonicalizationError(
            f"layer {name!r} of cache group {group} is missing from kv_caches "
            f"(it has {len(known)} layers: {shown})"
        ) from None


def _check_bounds(name: str, cache: CacheInput, pages: LayerPages, num_blocks: int) -> None:
    end = pages.offset + (num_blocks - 1) * pages.block_stride + pages.slot_bytes
    size = pages.source.untyped_storage().nbytes()
    if pages.offset < 0 or end > size:
        raise CanonicalizationError(
            f"layer {name!r} ({describe(cache)}): its {num_blocks} pages of "
            f"{pages.slot_bytes} bytes (stride {pages.block_stride}) end at byte {end} of an "
            f"allocation of {size} bytes"
        )


def _check_aliases(kv_caches: Mapping[str, CacheInput], groups: Sequence[KVCacheGroup]) -> None:
    """A name in no group is fine only if it views exactly a grouped layer's cache
    (cross-layer KV sharing); otherwise its bytes would silently not be offloaded."""
    grouped = {name for group in groups for name in group.layer_names}
    known = {_identity(kv_caches[name]) for name in grouped}
    for name, cache in kv_caches.items():
        if name not in grouped and _identity(cache) not in known:
            raise CanonicalizationError(
                f"layer {name!r} ({describe(cache)}) is in kv_caches but in no cache group, "
                f"and it is not a view of any grouped layer's cache; add it to a group"
            )


def _identity(cache: CacheInput) -> tuple:
    tensors = [cache] if isinstance(cache, torch.Tensor) else list(cache)
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors)


def _cluster(members: list[_Member], num_blocks: int) -> list[_Cluster]:
    """Merge pages that share bytes within a block (same stride, overlapping)."""
    key = lambda m: (str(m.pages.source.device), m.pages.block_stride, m.pages.address)  # noqa: E731
    clusters: list[_Cluster] = []
    for member in sorted(members, key=key):
        pages = member.pages
        last = clusters[-1] if clusters else None
        if (last is not None and last.stride == pages.block_stride
                and pages.source.device == last.members[0].pages.source.device
                and pages.address < last.start + last.width):
            if pages.source.untyped_storage().data_ptr() != \
                    last.members[0].pages.source.untyped_storage().data_ptr():
                raise CanonicalizationError(
                    f"layers {last.members[0].layer!r} and {member.layer!r} overlap but "
                    f"live in different allocations"
                )
            last.width = max(last.width, pages.address + pages.slot_bytes - last.start)
        else:
            last = _Cluster(pages.address, pages.block_stride, pages.slot_bytes)
            clusters.append(last)
        last.members.append(member)
        if num_blocks > 1 and last.width > last.stride:
            names = sorted({m.layer for m in last.members})
            raise CanonicalizationError(
                f"layers {names} overlap across blocks: their pages span {last.width} bytes "
                f"but blocks are {last.stride} bytes apart"
            )
    return clusters


def _check_disjoint(clusters: list[_Cluster], num_blocks: int) -> None:
    """No two canonical tensors may share a byte in any block."""
    order = sorted(clusters, key=lambda c: c.start)
    for i, a in enumerate(order):
        a_end = a.extent_end(num_blocks)
        for b in order[i + 1:]:
            if b.start >= a_end:
                break
            same_device = a.members[0].pages.source.device == b.members[0].pages.source.device
            if same_device and _interleaved_overlap(a, b, num_blocks):
                raise CanonicalizationError(
                    f"layers {a.members[0].layer!r} and {b.members[0].layer!r} share bytes "
                    f"in different blocks (block strides {a.stride} and {b.stride}); "
                    f"cannot prove a block-to-page mapping"
                )


def _interleaved_overlap(a: _Cluster, b: _Cluster, num_blocks: int) -> bool:
    """Whether some page of `a` overlaps some page of `b` (a.start <= b.start)."""
    if a.stride != b.stride:
        return True  # extents overlap and the pages interleave irregularly
    stride, d = a.stride, b.start - a.start
    # Page a_i and page b_j overlap iff d - a.width < (i - j) * stride < d + b.width.
    k = max((d - a.width) // stride + 1, -(num_blocks - 1))
    return k <= num_blocks - 1 and k * stride < d + b.width


def _build(
    clusters: list[_Cluster], groups: Sequence[KVCacheGroup], num_blocks: int
) -> CanonicalKVCaches:
    tensors: list[CanonicalTensor] = []
    group_refs: list[list[CanonicalRef]] = [[] for _ in groups]
    seen: set[tuple[int, int, int]] = set()
    for idx, cluster in enumerate(clusters):
        source = cluster.members[0].pages.source
        storage = source.untyped_storage()
        view = torch.empty(0, dtype=torch.int8, device=source.device).set_(
            storage, cluster.start - storage.data_ptr(), (num_blocks, cluster.width),
            (cluster.stride, 1),
        )
        names = tuple(dict.fromkeys(m.layer for m in cluster.members))
        tensors.append(CanonicalTensor(view, cluster.width, names))
        for m in cluster.members:
            offset = m.pages.address - cluster.start
            if (m.group, idx, offset) in seen:
                continue  # an alias of a layer this group already moves
            seen.add((m.group, idx, offset))
            group_refs[m.group].append(
                CanonicalRef(idx, m.pages.nbytes, offset, m.pages.slot_bytes, m.layer)
            )
    for refs, group in zip(group_refs, groups):
        position = {name: i for i, name in enumerate(group.layer_names)}
        refs.sort(key=lambda r: (position[r.layer_name], r.tensor_idx, r.offset_bytes))
    return CanonicalKVCaches(tensors, group_refs, num_blocks)
