"""A copy plan: which block goes to which slot (or back), checked once per job.

The caller gives, per cache group, engine block ids and host slot ids (pair i
moves block_ids[i] <-> slot_ids[i]). The plan validates them (range, one
source per destination), drops exact repeats, sorts the pairs by destination
and merges pairs that continue each other on both sides into runs, so the
executors can move each run with one large copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from kv_offload.errors import TransferError
from kv_offload.transfer import Direction
from kv_offload.types import IdsLike

try:  # built by the install where a C compiler is found (pyproject.toml: ext-modules)
    from kv_offload.kernels import _host_rows as HOST_ROWS
except ImportError:  # pragma: no cover - depends on the install
    HOST_ROWS = None  # (tests set it to None to run the numpy path)

RADIX_MIN_IDS = 1024  # (benchmarks/bench_plan_sort.py: from here on the radix sort wins)


@dataclass(frozen=True)
class GroupPlan:
    """The validated pairs of one group, sorted by destination.

    `src`/`dst` are row ids on each side (blocks or slots, by direction)."""

    group: int
    src: np.ndarray
    dst: np.ndarray

    @property
    def num_pairs(self) -> int:
        return int(self.src.size)

    @cached_property
    def runs(self) -> np.ndarray:
        """(src start, dst start, length) rows where both sides step by one, in
        destination order."""
        return merge_runs(self.src, self.dst)


@dataclass(frozen=True)
class CopyPlan:
    direction: Direction
    groups: tuple[GroupPlan, ...]
    num_bytes: int  # real bytes this plan moves

    @property
    def num_pairs(self) -> int:
        return sum(g.num_pairs for g in self.groups)


def plan_copy(
    direction: Direction,
    transfers: Mapping[int, tuple[IdsLike, IdsLike]],
    *,
    num_blocks: int,
    num_slots: int,
    block_bytes: Sequence[int],
) -> CopyPlan:
    """Check and plan `transfers` ({group: (block_ids, slot_ids)}).

    `block_bytes[g]` is the real bytes one block of group g moves. Raises
    `TransferError` naming the group and the offending id."""
    if not isinstance(direction, Direction):
        raise TransferError(f"direction must be a Direction, got {direction!r}")
    groups, total = [], 0
    for group, ids in sorted(transfers.items()):
        if not isinstance(group, int) or not 0 <= group < len(block_bytes):
            raise TransferError(f"cache group {group!r} does not exist; there are "
                                f"{len(block_bytes)} groups (0..{len(block_bytes) - 1})")
        if not isinstance(ids, tuple) or len(ids) != 2:
            raise TransferError(f"group {group}: expected (block_ids, slot_ids), got {ids!r}")
        blocks = id_array(ids[0], "block", group, num_blocks)
        slots = id_array(ids[1], "slot", group, num_slots)
        if blocks.size != slots.size:
            raise TransferError(f"group {group}: {blocks.size} block ids but {slots.size} "
                                f"slot ids; expected one slot per block")
        if direction is Direction.STORE:
            plan = pair_up(group, blocks, slots, "slot", num_slots)
        else:
            plan = pair_up(group, slots, blocks, "block", num_blocks)
        if plan.num_pairs:
            groups.append(plan)
            total += plan.num_pairs * block_bytes[group]
    if direction is Direction.STORE and len(groups) > 1:
        _check_slots_disjoint(groups)
    return CopyPlan(direction, tuple(groups), total)


def _check_slots_disjoint(groups: list[GroupPlan]) -> None:
    """A slot holds one block of one group: no two groups may write it."""
    slots = np.concatenate([g.dst for g in groups])
    owner = np.concatenate([np.full(g.dst.size, g.group) for g in groups])
    order = np.argsort(slots, kind="stable")
    same = np.flatnonzero(np.diff(slots[order]) == 0)
    if same.size:
        i = order[same[0] + 1]
        raise TransferError(f"group {int(owner[i])}: slot {int(slots[i])} is also written by "
                            f"another group in this job")


def id_array(values: IdsLike, kind: str, group: int, limit: int | None = None, *,
             copy: bool = False) -> np.ndarray:
    """Block or slot ids as a 1-D int64 array (the one check of ids, wherever they come
    in); `limit`: they must be in `[0, limit)`; `copy`: never a view of the caller's."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.array(values) if copy else np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise TransferError(f"group {group}: {kind} ids must be a 1-D sequence of ints, got "
                            f"dtype {array.dtype} shape {array.shape}")
    array = array.astype(np.int64, copy=False)
    if limit is None:
        return array
    bad = (array < 0) | (array >= limit)
    if bad.any():
        raise TransferError(f"group {group}: {kind} id {int(array[bad][0])} is out of range; "
                            f"expected 0 <= id < {limit}")
    return array


def pair_up(group: int, src: np.ndarray, dst: np.ndarray, dst_kind: str,
            limit: int) -> GroupPlan:
    """Checked ids -> a GroupPlan sorted by destination; exact repeats dropped,
    two sources for one destination refused."""
    order = argsort_ids(dst, limit)
    if order is not None:
        src, dst = src[order], dst[order]
    # (neighbours compared once, a bool per pair, instead of three int64 diffs: a large
    # plan's temporaries are a measurable part of a load job of small pages)
    same_dst = np.flatnonzero(dst[1:] == dst[:-1]) if dst.size > 1 else dst[:0]
    if same_dst.size:
        repeat = same_dst[src[same_dst + 1] == src[same_dst]]
        if repeat.size:  # the same pair twice: move it once
            keep = np.ones(dst.size, dtype=bool)
            keep[repeat + 1] = False
            src, dst = src[keep], dst[keep]
        clash = np.flatnonzero(dst[1:] == dst[:-1])
        if clash.size:
            i = clash[0]
            raise TransferError(f"group {group}: {dst_kind} {int(dst[i])} would receive two "
                                f"different sources ({int(src[i])} and {int(src[i + 1])})")
    return GroupPlan(group, src, dst)


def argsort_ids(ids: np.ndarray, limit: int) -> np.ndarray | None:
    """A stable argsort of int64 ids in [0, limit), or None when they are sorted already.

    Dense ids without repeats (a job's blocks or slots, most often) are placed by
    counting: tens of microseconds for thousands of ids, where comparison sorting takes
    hundreds. Others go to the compiled radix sort where the package was built with a C
    compiler (`_host_rows.order_ids`: linear for any limit up to 2**32; 128k ids below
    4M: 0.9 to 1.4 ms), else to numpy's comparison sort (10 to 12 ms for those; a few
    microseconds faster below `RADIX_MIN_IDS`, where the radix sort's fixed cost
    dominates). Repeated dense ids try the counting first (it finds the repeats)."""
    if ids.size < 2 or not (ids[1:] < ids[:-1]).any():
        return None
    if limit <= 8 * ids.size:
        position = np.full(limit, -1, dtype=np.int64)
        position[ids] = np.arange(ids.size)
        present = np.flatnonzero(position >= 0)
        if present.size == ids.size:  # no id repeats: this is the whole order
            return position[present]
    if HOST_ROWS is not None and ids.size >= RADIX_MIN_IDS and limit <= 1 << 32:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        order = np.empty(ids.size, dtype=np.int64)
        HOST_ROWS.order_ids(ids.ctypes.data, ids.size, limit, order.ctypes.data)
        return order
    return np.argsort(ids, kind="stable")


def merge_runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """(start src, start dst, length) of maximal stretches where both ids step by one."""
    if src.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return np.stack([src[starts], dst[starts], lengths], axis=1)


def stretches(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start positions and lengths of maximal stretches of consecutive ids."""
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(ids) != 1) + 1))
    return starts, np.diff(np.concatenate((starts, [ids.size])))
