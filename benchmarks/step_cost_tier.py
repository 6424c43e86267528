"""The step-cost benchmark's storage tier: a `StorageTier` whose in-memory index holds a
large inventory (1,000,000 keys by default), as a full disk tier would after a restart,
without touching a disk.

Why synthetic: the benchmark measures what our bookkeeping costs per engine step at a given
number of stored keys, not I/O. A million real files would measure the filesystem (and take
minutes to create); the index is what the engine-facing code sees. So the tier keeps keys,
not bytes: a read fills the buffer with a pattern derived from the key, a write records the
key only. It behaves like a full tier: past `capacity` keys each new write evicts the
oldest key, and both show in its change feed.

The change feed (`take_changes`, the current tree's hook) streams the initial inventory in
bounded batches, after the changes made since; the "before" tree lists `keys()` instead.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence

import torch
from step_cost_compat import StorageTier, TierChanges, TierJobResult, TierStats


class SyntheticTier(StorageTier):
    """A full tier of `len(inventory)` keys, indexed in memory. A write updates the index
    at once; a read fills its buffers at the next `poll`."""

    def __init__(self, inventory: Sequence[bytes], *, page_bytes: int,
                 capacity: int | None = None) -> None:
        self.page_bytes = page_bytes
        self.capacity = capacity or len(inventory)
        self._lock = threading.Lock()  # the pump, the engine thread and keys() may overlap
        self._index: OrderedDict[bytes, None] = OrderedDict.fromkeys(inventory)  # FIFO
        self._unlisted = tuple(self._index)  # the inventory, sent from `_cursor` on
        self._cursor = 0
        self._feed_read = False  # a tree that reads the change feed (not `keys()`)
        self._changes: dict[bytes, bool] = {}  # since the last take: key -> added (latest wins)
        self._results: list[TierJobResult] = []
        self._reads: list[tuple] = []  # (job id, keys, buffers, held): filled at `poll`
        self._ids = itertools.count(1)
        self.counts: Counter[str] = Counter()

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._index for key in keys]

    def submit_write(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        with self._lock:
            for key in keys:
                if key in self._index:
                    continue
                if len(self._index) >= self.capacity:  # full: the oldest key goes
                    evicted, _ = self._index.popitem(last=False)
                    self._changes[evicted] = False
                    self.counts["evicted"] += 1
                self._index[key] = None
                self._changes[key] = True
            self.counts["written"] += len(keys)
            job_id = next(self._ids)
            self._results.append(TierJobResult(job_id, tuple(keys), (True,) * len(keys)))
            return job_id

    def submit_read(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        """The buffers are filled by the next `poll` (the pump thread), as a real tier's
        I/O threads would, not on the engine thread."""
        with self._lock:
            job_id = next(self._ids)
            self._reads.append((job_id, tuple(keys), buffers,
                                tuple(key in self._index for key in keys)))
            return job_id

    def poll(self) -> list[TierJobResult]:
        with self._lock:
            reads, self._reads = self._reads, []
        for _, keys, buffers, ok in reads:
            for key, buffer, held in zip(keys, buffers, ok):
                if held:  # bytes are not kept: a pattern stands in for them
                    buffer.fill_(key[-1] % 127)
        with self._lock:
            for job_id, keys, _, ok in reads:
                self.counts["read"] += sum(ok)
                self._results.append(TierJobResult(job_id, keys, ok))
            done, self._results = self._results, []
            return done

    def close(self) -> None:
        pass

    def take_changes(self, max_keys: int) -> TierChanges:
        """Changes since the last call first, then the next slice of the initial inventory
        (keys evicted meanwhile are skipped): at most `max_keys` keys."""
        added, removed = [], []
        with self._lock:
            self._feed_read = True
            changes = self._changes
            while changes and len(added) + len(removed) < max_keys:
                key, was_added = changes.popitem()
                (added if was_added else removed).append(key)
            room = max_keys - len(added) - len(removed)
            end = min(len(self._unlisted), self._cursor + room)
            index = self._index
            added += [key for key in self._unlisted[self._cursor:end] if key in index]
            self._cursor = end
        return TierChanges(tuple(added), tuple(removed))

    def inventory_left(self) -> int:
        """Keys of the initial inventory not yet handed out by `take_changes` (0 for a tree
        that lists `keys()` instead of reading the change feed)."""
        with self._lock:
            return len(self._unlisted) - self._cursor if self._feed_read else 0

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def stats(self) -> TierStats:
        held = len(self._index)
        return TierStats(keys=held, bytes_used=held * self.page_bytes,
                         bytes_budget=self.capacity * self.page_bytes)
