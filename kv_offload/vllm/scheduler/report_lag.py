"""How far the workers' reports reflect the scheduler's plans, and the stores planned since.

A worker reports the keys its stores added only once those stores are copied out of
engine memory, so a report lags the plans by a step or more. `ReportLag` remembers, per
plan step, the keys stored and any reset, and the last step every rank says its reports
reflect (`RankReport.reflected_step`). A lookup counts the keys of stores planned and not
yet reflected as held in host memory on every rank (`planned`): the worker that receives a
load of such a key waits for that store (`store.loads`), and if the store does not land
the load fails that block (a recompute). Once a step is reflected its keys leave `planned`
and the ranks' reports say whether they are held (a failed store is then simply absent).
A lookup during a reset waits for the reset's report instead.

Costs: `planned_stores` O(keys stored), `reported` O(keys whose step became reflected),
`planned(group)` O(1) (a map the lookup reads in C).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from kv_offload.types import OffloadKey

_EMPTY: dict = {}  # (never written)


class ReportLag:
    """Plan steps not yet reflected by every rank's reports."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._by_rank: dict[int, int] = {}  # rank -> last step its reports reflect
        self._stores: deque[tuple[int, list[OffloadKey]]] = deque()  # (step, keys)
        # group -> block hash -> the last plan step storing it, not yet reflected
        self._planned: dict[int, dict[bytes, int]] = {}
        self.reset_step: int | None = None  # a reset planned and not yet reflected

    @property
    def reflected(self) -> int:
        """The last plan step every rank's reports reflect (-1 until all reported)."""
        if len(self._by_rank) < self.world_size:
            return -1
        return min(self._by_rank.values())

    def planned_stores(self, step: int, keys: list[OffloadKey]) -> None:
        if keys:
            self._stores.append((step, keys))
            planned = self._planned
            for block_hash, group in keys:
                hashes = planned.get(group)
                if hashes is None:
                    hashes = planned[group] = {}
                hashes[block_hash] = step

    def reported(self, rank: int, reflected_step: int) -> None:
        self._by_rank[rank] = reflected_step
        reflected = self.reflected
        if self.reset_step is not None and self.reset_step <= reflected:
            self.reset_step = None
        while self._stores and self._stores[0][0] <= reflected:
            step, keys = self._stores.popleft()
            for block_hash, group in keys:
                hashes = self._planned[group]
                if hashes.get(block_hash) == step:
                    del hashes[block_hash]

    def planned(self, group: int) -> Mapping[bytes, int]:
        """The block hashes of `group` whose stores are planned and not yet reflected by
        every rank's reports (read-only)."""
        return self._planned.get(group, _EMPTY)
