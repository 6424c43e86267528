"""How far the workers' reports reflect the scheduler's plans.

A worker reports the keys its stores added only once those stores are copied out of
engine memory, so a report lags the plans by a step or more. `ReportLag` remembers, per
plan step, the keys stored and any reset, and the last step every rank says its reports
reflect (`RankReport.reflected_step`); a lookup whose prefix is being stored (or that
comes during a reset) waits for the report instead of missing.

Costs: `planned_stores` O(keys stored), `reported` O(keys whose step became reflected),
`last_unreported_store` O(the request's hashes) but only once per wait (the caller
remembers the step it waits for).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from kv_offload.specs import KVCacheSpec
from kv_offload.types import OffloadKey


class ReportLag:
    """Plan steps not yet reflected by every rank's reports."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._by_rank: dict[int, int] = {}  # rank -> last step its reports reflect
        self._stores: deque[tuple[int, list[OffloadKey]]] = deque()  # (step, keys)
        self._store_step: dict[OffloadKey, int] = {}  # key -> last step storing it
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
            self._store_step.update(dict.fromkeys(keys, step))

    def reported(self, rank: int, reflected_step: int) -> None:
        self._by_rank[rank] = reflected_step
        reflected = self.reflected
        if self.reset_step is not None and self.reset_step <= reflected:
            self.reset_step = None
        while self._stores and self._stores[0][0] <= reflected:
            step, keys = self._stores.popleft()
            for key in keys:
                if self._store_step.get(key) == step:
                    del self._store_step[key]

    def last_unreported_store(self, request: Any, specs: Sequence[KVCacheSpec],
                              hash_block_size: int) -> int:
        """The last plan step storing one of `request`'s blocks not yet reflected (-1:
        none)."""
        if not self._store_step:
            return -1
        last = -1
        hashes = request.block_hashes
        for g, spec in enumerate(specs):
            per_block = spec.block_size // hash_block_size
            for index in range(per_block - 1, len(hashes), per_block):
                last = max(last, self._store_step.get((hashes[index], g), -1))
        return last
