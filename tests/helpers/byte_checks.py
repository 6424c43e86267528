"""Address-level checks for canonical views, independent of canonicalize()'s logic.

Every byte of an engine view is located from the view's own shape and strides;
a canonical page must cover exactly the bytes of its layer's logical block.
"""

from __future__ import annotations

import numpy as np
import torch

from kv_offload import CanonicalKVCaches, KVCacheGroup, canonicalize


def byte_offsets(view: torch.Tensor) -> np.ndarray:
    """Byte offsets (from the storage start) of every byte of `view`, in logical order."""
    item = view.element_size()
    offsets = np.array([view.storage_offset() * item], dtype=np.int64)
    for size, stride in zip(view.shape, view.stride()):
        offsets = (offsets[..., None] + np.arange(size, dtype=np.int64) * stride * item)
    return (offsets[..., None] + np.arange(item, dtype=np.int64)).reshape(-1)


def logical_block(cache, block: int, num_blocks: int) -> list[torch.Tensor]:
    """The engine's own view(s) of one manager block of one layer."""
    if not isinstance(cache, torch.Tensor):
        return [state[block] for state in cache]
    if cache.dim() == 5 and cache.shape[0] == 2 and cache.shape[1] != 2:
        ratio = cache.shape[1] // num_blocks
        return [cache[:, block * ratio:(block + 1) * ratio]]
    ratio = cache.shape[0] // num_blocks
    return [cache[block * ratio:(block + 1) * ratio]]


def storage_bytes(cache) -> np.ndarray:
    """All bytes of the allocation behind a layer, as a writable numpy array."""
    tensor = cache if isinstance(cache, torch.Tensor) else cache[0]
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.int8).set_(storage).numpy()


def block_addresses(cache, block: int, num_blocks: int) -> np.ndarray:
    """Sorted absolute addresses of one layer's logical block."""
    tensor = cache if isinstance(cache, torch.Tensor) else cache[0]
    base = tensor.untyped_storage().data_ptr()
    parts = [byte_offsets(v) for v in logical_block(cache, block, num_blocks)]
    return np.sort(np.concatenate(parts)) + base


def ref_addresses(canonical: CanonicalKVCaches, ref, block: int) -> np.ndarray:
    view = canonical.tensors[ref.tensor_idx].tensor
    start = view.data_ptr() + block * view.stride(0) + ref.offset_bytes
    return np.arange(start, start + ref.page_size_bytes, dtype=np.int64)


def layer_caches(kv_caches, groups: list[KVCacheGroup]):
    """(group index, layer name, cache) for every grouped layer."""
    return [(g, name, kv_caches[name]) for g, grp in enumerate(groups) for name in grp.layer_names]


def sampled(names: list[str], sample: int | None) -> list[str]:
    """All names, or `sample` of them spread evenly (first and last included)."""
    if sample is None or len(names) <= sample:
        return list(names)
    step = (len(names) - 1) / (sample - 1)
    return [names[round(i * step)] for i in range(sample)]


def fill_pattern(kv_caches, groups, num_blocks: int, sample: int | None = None) -> None:
    """Write a byte pattern encoding (layer, block, position) through each layer's
    logical view (later layers overwrite aliased bytes, as an engine would)."""
    chosen = {name for grp in groups for name in sampled(grp.layer_names, sample)}
    for layer_idx, (_, name, cache) in enumerate(layer_caches(kv_caches, groups)):
        if name not in chosen:
            continue
        memory = storage_bytes(cache)
        for block in range(num_blocks):
            offsets = np.concatenate(
                [byte_offsets(v) for v in logical_block(cache, block, num_blocks)]
            )
            position = np.arange(offsets.size, dtype=np.int64)
            memory[offsets] = ((layer_idx * 131 + block * 31 + position * 7) % 251 - 125)


def assert_canonical_matches(
    canonical: CanonicalKVCaches, kv_caches, groups, sample: int | None = None
) -> None:
    """Every ref's page b holds exactly its layer's bytes of block b, in address
    order, and the layer's refs together cover the whole logical block."""
    num_blocks = canonical.num_blocks
    for g, refs in enumerate(canonical.group_refs):
        by_layer: dict[str, list] = {}
        for ref in refs:
            by_layer.setdefault(ref.layer_name, []).append(ref)
        grouped = set(groups[g].layer_names)
        assert set(by_layer) <= grouped, f"group {g} refs name foreign layers"
        for name in sampled(groups[g].layer_names, sample):
            cache = kv_caches[name]
            for block in range(num_blocks):
                expected = block_addresses(cache, block, num_blocks)
                covered = np.sort(np.concatenate(
                    [ref_addresses(canonical, r, block) for r in by_layer.get(name, [])]
                    or [np.empty(0, np.int64)]))
                if name not in by_layer:
                    # An alias of another layer of this group: its bytes must be moved by it.
                    others = np.concatenate([ref_addresses(canonical, r, block) for r in refs])
                    assert np.isin(expected, others).all(), f"{name} block {block} not moved"
                    continue
                assert np.array_equal(covered, expected), f"{name} block {block}: wrong bytes"
                for ref in by_layer[name]:
                    page = canonical.tensors[ref.tensor_idx].tensor[block]
                    data = page[ref.offset_bytes:ref.offset_bytes + ref.page_size_bytes].numpy()
                    memory = storage_bytes(cache)
                    base = page.untyped_storage().data_ptr()
                    assert np.array_equal(data, memory[ref_addresses(canonical, ref, block)
                                                       - base])


def assert_writes_stay_in_block(
    canonical: CanonicalKVCaches, kv_caches, groups, sample: int | None = None
) -> None:
    """Inverting a ref's page b through the canonical view changes exactly the
    bytes of its layer's logical block b in the engine allocation."""
    for g, refs in enumerate(canonical.group_refs):
        for block in range(canonical.num_blocks):
            for name in sampled(list(dict.fromkeys(r.layer_name for r in refs)), sample):
                cache = kv_caches[name]
                memory = storage_bytes(cache)
                before = memory.copy()
                for ref in (r for r in refs if r.layer_name == name):
                    page = canonical.tensors[ref.tensor_idx].tensor[block]
                    page[ref.offset_bytes:ref.offset_bytes + ref.page_size_bytes].bitwise_not_()
                changed = np.flatnonzero(memory != before)
                base = (cache if isinstance(cache, torch.Tensor) else cache[0])
                expected = block_addresses(cache, block, canonical.num_blocks)
                expected = expected - base.untyped_storage().data_ptr()
                assert np.array_equal(changed, expected), f"group {g} {name} block {block}"
                memory[:] = before


def assert_tensors_disjoint(canonical: CanonicalKVCaches) -> None:
    """No byte belongs to two canonical tensors."""
    addresses = np.concatenate([
        byte_offsets(t.tensor) + t.tensor.untyped_storage().data_ptr() for t in canonical.tensors
    ])
    assert np.unique(addresses).size == addresses.size, "canonical tensors overlap"


def canonicalize_and_check(kv_caches, groups, num_blocks: int, sample: int | None = None):
    """Canonicalise, then prove the mapping both ways on the real bytes (on
    `sample` layers per group for the full-size example models)."""
    fill_pattern(kv_caches, groups, num_blocks, sample)
    canonical = canonicalize(kv_caches, groups, num_blocks)
    assert_canonical_matches(canonical, kv_caches, groups, sample)
    assert_writes_stay_in_block(canonical, kv_caches, groups, sample)
    assert_tensors_disjoint(canonical)
    for t in canonical.tensors:
        assert t.tensor.dtype == torch.int8 and t.tensor.shape == (num_blocks, t.page_size_bytes)
    return canonical
