"""Where each block's bytes live on both sides of a copy.

Host side: one *slot* holds one block of one cache group: the group's refs'
`slot_bytes` back to back, in ref order (a padded page reserves its whole slot
but only its real bytes are ever copied). Every slot has the same size, the
largest `slot_bytes_per_block` over the groups, so any slot can hold a block of
any group and the manager hands out plain slot ids in `[0, num_slots)`.

Engine side: the canonical tensors. Refs of a group that repeat at a constant
address step on both sides (e.g. the layers of an LBNHC buffer, each its own
canonical tensor) are fused into one *segment*: a `(blocks, refs, bytes)`
strided view on each side, so a copy moves all those layers in one operation.
Views use the widest integer type that divides every offset and stride, which
speeds up element-wise kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_offload.canonical import CanonicalKVCaches, CanonicalRef

_WIDE_TYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.int8))


@dataclass(frozen=True)
class HostSlotLayout:
    """Byte layout of one host slot, per cache group."""

    slot_bytes: int
    ref_offsets: tuple[tuple[int, ...], ...]  # [group][ref] -> byte offset inside a slot
    group_bytes: tuple[int, ...]  # [group] -> bytes a block of the group reserves

    @classmethod
    def from_canonical(cls, canonical: CanonicalKVCaches) -> HostSlotLayout:
        offsets, sizes = [], []
        for refs in canonical.group_refs:
            starts, end = [], 0
            for ref in refs:
                starts.append(end)
                end += ref.slot_bytes
            offsets.append(tuple(starts))
            sizes.append(end)
        return cls(max(sizes, default=0), tuple(offsets), tuple(sizes))


@dataclass(frozen=True)
class Segment:
    """Refs of one group that move as one strided row per block.

    `engine[b]` and `host[s]` are `(len(refs), row)` views of block b's and slot
    s's bytes for these refs; both have the same shape and element type."""

    group: int
    refs: tuple[int, ...]
    engine: torch.Tensor
    host: torch.Tensor

    @property
    def block_bytes(self) -> int:
        """Bytes this segment moves per block."""
        return self.engine[0].numel() * self.engine.element_size()


@dataclass(frozen=True)
class _Run:
    """A ref's placement: engine storage + address of block 0, host offset."""

    ref: int
    storage: torch.UntypedStorage
    engine_offset: int  # bytes from the storage start to block 0's data
    block_stride: int
    nbytes: int
    host_offset: int
    slot_bytes: int


def build_segments(
    canonical: CanonicalKVCaches, layout: HostSlotLayout, pool: torch.Tensor, *,
    fuse: bool = True
) -> list[list[Segment]]:
    """Per group, the segments that together cover every ref's real bytes.

    `pool` is the host memory: an int8 `(num_slots, layout.slot_bytes)` tensor. `fuse`
    False: one segment per ref (copies cut per layer, `store/host/layer_copies.py`)."""
    if pool.dtype != torch.int8 or pool.dim() != 2 or pool.shape[1] != layout.slot_bytes:
        raise ValueError(
            f"host pool must be int8 (num_slots, {layout.slot_bytes}), got {pool.dtype} "
            f"{tuple(pool.shape)}"
        )
    if not pool.is_contiguous():
        raise ValueError("host pool must be contiguous")
    segments = []
    for g, refs in enumerate(canonical.group_refs):
        runs = [_place(canonical, i, ref, layout.ref_offsets[g][i]) for i, ref in enumerate(refs)]
        segments.append([
            _segment(g, chunk, canonical.num_blocks, pool)
            for chunk in (_fuse(runs) if fuse else [[run] for run in runs])
        ])
    return segments


def _place(canonical: CanonicalKVCaches, index: int, ref: CanonicalRef, host: int) -> _Run:
    view = canonical.tensors[ref.tensor_idx].tensor
    return _Run(index, view.untyped_storage(), view.storage_offset() + ref.offset_bytes,
                view.stride(0), ref.page_size_bytes, host, ref.slot_bytes)


def _fuse(runs: list[_Run]) -> list[list[_Run]]:
    """Split the refs (in host order) into chunks at a constant step on both sides."""
    chunks: list[list[_Run]] = []
    for run in runs:
        chunk = chunks[-1] if chunks else None
        if chunk and _extends(chunk, run):
            chunk.append(run)
        else:
            chunks.append([run])
    return chunks


def _extends(chunk: list[_Run], run: _Run) -> bool:
    last = chunk[-1]
    same_shape = (
        run.storage.data_ptr() == last.storage.data_ptr()
        and run.storage.device == last.storage.device
        and run.block_stride == last.block_stride
        and run.nbytes == last.nbytes
        and run.host_offset - last.host_offset == last.slot_bytes
    )
    step = run.engine_offset - last.engine_offset
    if not same_shape or step < run.nbytes:  # a view must not overlap itself
        return False
    if len(chunk) == 1:
        return True
    return (step == last.engine_offset - chunk[-2].engine_offset
            and last.slot_bytes == chunk[-2].slot_bytes)


def _segment(group: int, chunk: list[_Run], num_blocks: int, pool: torch.Tensor) -> Segment:
    first = chunk[0]
    count, nbytes = len(chunk), first.nbytes
    engine_step = chunk[1].engine_offset - first.engine_offset if count > 1 else nbytes
    host_step = first.slot_bytes
    pool_offset = pool.storage_offset()  # int8: elements are bytes
    if engine_step == nbytes and host_step == nbytes:
        count, nbytes = 1, count * nbytes  # dense on both sides: one wide row
        engine_step = host_step = nbytes
    slot = pool.stride(0)
    host_start = pool_offset + first.host_offset
    width = next(w for w, _ in _WIDE_TYPES if all(
        v % w == 0 for v in (first.engine_offset, first.block_stride, engine_step, nbytes,
                             host_start, slot, host_step)))
    dtype = dict(_WIDE_TYPES)[width]
    engine = _view(first.storage, dtype, first.engine_offset // width,
                   (num_blocks, count, nbytes // width),
                   (first.block_stride // width, engine_step // width, 1))
    host = _view(pool.untyped_storage(), dtype, host_start // width,
                 (pool.shape[0], count, nbytes // width),
                 (slot // width, host_step // width, 1))
    return Segment(group, tuple(r.ref for r in chunk), engine, host)


def _view(storage: torch.UntypedStorage, dtype: torch.dtype, offset: int,
          size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
