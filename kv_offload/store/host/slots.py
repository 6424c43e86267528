"""SlotMap: the manager's slot ids -> rows of the host pool.

Why a map: a store may put its blocks into its own slots' rows in any order,
and it puts them in engine-address order. The copy then reads engine memory
front to back instead of jumping around; on this machine random-order reads of
16 KiB pages run at about two thirds of the speed of ordered ones, while the
order of writes hardly matters. Loads and secondary tiers find a slot's bytes
through the map (`HostTier.slot_buffer`); a slot keeps its row until a later
store of that same slot.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np

from kv_offload.kernels.plan import CopyPlan, Direction, GroupPlan, argsort_ids


class SlotMap:
    def __init__(self, num_slots: int) -> None:
        self._rows = np.arange(num_slots, dtype=np.int64)
        self._lock = threading.Lock()

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """The pool rows holding these slots now (ids must be in range)."""
        with self._lock:
            return self._rows[slots]

    def physical(self, plan: CopyPlan, num_blocks: int) -> CopyPlan:
        """The same plan in pool rows instead of slot ids. A store first hands its
        slots their own rows again, in block order. Both keep the plan's order
        (sorted by destination) so nothing needs planning twice."""
        groups = []
        with self._lock:
            for group in plan.groups:
                if plan.direction is Direction.STORE:  # src: blocks, dst: distinct slots
                    rows = self._rows[group.dst]
                    order = argsort_ids(rows, self._rows.size)
                    rows = rows if order is None else rows[order]
                    by_block = argsort_ids(group.src, num_blocks)
                    blocks, slots = ((group.src, group.dst) if by_block is None
                                     else (group.src[by_block], group.dst[by_block]))
                    self._rows[slots] = rows
                    groups.append(GroupPlan(group.group, blocks, rows))
                else:  # src: slots, dst: blocks (sorted, distinct)
                    groups.append(GroupPlan(group.group, self._rows[group.src], group.dst))
        return replace(plan, groups=tuple(groups))
