"""Where the tree under test spells the engine-facing API differently, detected once at
import: the current tree (worker reports from a change feed, `RankReport`s of `KeyChange`s)
or commit 2505ae9, the "before" of issue 11 (the worker lists `keys()` of the storage tier
every second; reports are `(key, old, new)` int tuples).

Contents:
- `API`: "change feed" (current) or "listing" (2505ae9).
- `StorageTier`, `TierJobResult`, `TierChanges`, `TierStats`: the tier interface's records.
- `storage_key_of`, `step_started`, `start_loads`, `report_size`, `host_report`,
  `make_worker`.

The benchmark needs nothing else of either tree beyond what both spell the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_offload.config import OffloadConfig

try:  # the package's layout since issue 44
    from kv_offload.vllm.worker.offload_worker import OffloadWorker
except ImportError:  # an older tree (--before)
    from kv_offload.vllm.worker_side import OffloadWorker

try:  # the current tree: the tier interface with its change-feed hook
    from kv_offload.backends.base import StorageTier, TierChanges, TierJobResult, TierStats

    try:
        from kv_offload.store.key_view import storage_key as _storage_key
    except ImportError:  # before the layout (issue 44)
        from kv_offload.key_view import storage_key as _storage_key
    from kv_offload.types import KeyChange, Location
    from kv_offload.vllm.metadata import KVOffloadWorkerMetadata, RankReport

    API = "change feed"
except ImportError:  # commit 2505ae9: no change feed
    from kv_offload.tiering import storage_key as _storage_key
    from kv_offload.transfer import StorageTier, TierJobResult
    from kv_offload.vllm.metadata import IN_HOST, KVOffloadWorkerMetadata

    API = "listing"

    @dataclass(frozen=True)
    class TierChanges:  # type: ignore[no-redef]  (that tree's worker never asks for it)
        added: tuple[bytes, ...] = ()
        removed: tuple[bytes, ...] = ()

    @dataclass(frozen=True)
    class TierStats:  # type: ignore[no-redef]  (what that tree's take_stats reads)
        keys: int = 0
        bytes_used: int = 0
        bytes_budget: int = 0

__all__ = ["API", "StorageTier", "TierChanges", "TierJobResult", "TierStats", "host_report",
           "make_worker", "report_size", "start_loads", "step_started", "storage_key_of"]

# Trees since the pump yields between a forward's end and the next step's start are told
# when a step starts (the connector's handle_preemptions); older trees are not.
_TOLD_STEP_STARTS = "step_started" in vars(OffloadWorker)


def storage_key_of(key: tuple[bytes, int]) -> bytes:
    """The storage tier's key for an offload key, as the tree under test writes it (the
    current tree: generation 0, the one every engine starts in)."""
    return _storage_key(key)


def step_started(worker: OffloadWorker) -> None:
    """What the connector's `handle_preemptions` tells the worker first, in trees that have it."""
    if _TOLD_STEP_STARTS:
        worker.step_started()


def start_loads(worker: OffloadWorker, meta) -> None:
    """`start_loads` as each tree takes it (the current one also takes failed loads)."""
    if API == "change feed":
        worker.start_loads(meta.loads, meta.failed_loads)
    else:
        worker.start_loads(meta.loads)


def report_size(worker_meta) -> int:
    """Key changes carried by one worker report."""
    if worker_meta is None:
        return 0
    if API == "change feed":  # (columns since stop 20, `KeyChange` records before)
        return sum(len(getattr(report, "keys", None) or report.changes)
                   for report in worker_meta.reports.values())
    return sum(len(changes) for changes in worker_meta.changes.values())


def host_report(keys, reflected_step: int, host_slots: int):
    """Rank 0's report that `keys` are now in host memory (scheduler-only runs)."""
    if API == "change feed":
        changes = tuple(KeyChange(key, Location.HOST) for key in keys)
        make = getattr(RankReport, "of", RankReport)  # (columns since stop 20)
        return KVOffloadWorkerMetadata({0: make(changes, False, reflected_step)})
    return KVOffloadWorkerMetadata({0: [(key, 0, IN_HOST) for key in keys]},
                                   {0: host_slots}, {0: reflected_step})


def make_worker(config: OffloadConfig, kv_caches, groups, num_blocks: int,
                tier: StorageTier) -> OffloadWorker:
    """The real worker over these caches, with `tier` as its secondary tier (plugged into
    its `TieredStore` under the worker's lock, before any step)."""
    worker = OffloadWorker(config, 0, "step-cost-bench")
    worker.register(kv_caches, groups, num_blocks)
    with worker._lock:
        worker.store.storage = tier
    return worker
