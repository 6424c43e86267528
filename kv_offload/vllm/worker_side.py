"""The connector's worker side (one per worker rank): moves this rank's shard.

The engine's caches are canonicalised once; a `TieredStore` (host slots in front of the
optional disk tier) does the copies on its own threads, and a pump thread advances it so
write-through to disk keeps going while the engine is idle. Every call from vLLM takes the
same lock, so the store is only ever driven by one thread at a time.

Engine memory is only read by stores and written by loads:
- a store copies blocks the step's forward completed; vLLM may free them right after the
  step (a finished request, a sliding window moving on), so `wait_for_engine_copies` runs
  before the next forward and nothing can overwrite them mid-copy;
- a load fills blocks of a request that waits for it (vLLM does not run it, and keeps the
  blocks of an aborted one until the load reports back).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kv_offload.backends.base import TierStats
from kv_offload.canonical import CanonicalKVCaches, canonicalize
from kv_offload.config import OffloadConfig
from kv_offload.specs import KVCacheGroup
from kv_offload.tiering import TieredResult, TieredStore, layout_fingerprint
from kv_offload.vllm.metadata import (
    ABSENT,
    IN_HOST,
    ON_DISK,
    GroupBlocks,
    KVOffloadWorkerMetadata,
    OffloadKey,
)
from kv_offload.vllm.stats import KVOffloadStats

logger = logging.getLogger(__name__)

DISK_INVENTORY_INTERVAL_S = 1.0  # how often disk keys (evictions, other writers) are re-listed
_PUMP_INTERVAL_S = 0.002


@dataclass
class _Job:
    request_id: str | None  # loads: the request; stores: None
    started: float
    num_blocks: int
    num_bytes: int
    seconds: float = 0.0  # submit -> result


class OffloadWorker:
    """Worker-side state of the connector for one rank."""

    def __init__(self, config: OffloadConfig, rank: int, fingerprint_extra: str) -> None:
        self.config = config
        self.rank = rank
        self.fingerprint_extra = fingerprint_extra
        self.canonical: CanonicalKVCaches | None = None
        self.store: TieredStore | None = None
        self._on_cuda = False
        self._reflected_step = -1
        self._lock = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._results: list[tuple[TieredResult, _Job]] = []
        self._stats = KVOffloadStats()
        self._host: set[OffloadKey] = set()
        self._disk: set[OffloadKey] = set()
        self._reported: dict[OffloadKey, int] = {}  # as last told to the scheduler
        self._disk_listed_at = 0.0
        self._stop = threading.Event()
        self._pump: threading.Thread | None = None

    def register(self, kv_caches: Mapping[str, torch.Tensor], groups: list[KVCacheGroup],
                 num_blocks: int) -> None:
        """Canonicalise the engine's caches and open the tiers."""
        self.canonical = canonicalize(kv_caches, groups, num_blocks)
        self._on_cuda = any(t.tensor.is_cuda for t in self.canonical.tensors)
        fingerprint = layout_fingerprint(self.canonical, self.fingerprint_extra)
        self.store = TieredStore.from_config(self.canonical, self.config, fingerprint)
        self._pump = threading.Thread(target=self._run_pump, daemon=True,
                                      name=f"kv-offload-pump-{self.rank}")
        self._pump.start()

    # --- per step, in vLLM's order ---

    def wait_for_engine_copies(self, timeout_s: float = 120.0) -> None:
        """Block until every store submitted so far has copied its engine blocks out."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while any(job.request_id is None for job in self._jobs.values()):
                if not self._lock.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"kv-offload rank {self.rank}: stores did not copy "
                                       f"out of engine memory within {timeout_s} s")

    def begin_step(self, step: int) -> None:
        """A new step's plans arrived: the previous step's stores have been copied
        (`wait_for_engine_copies` ran before this step), so reports reflect them."""
        self._reflected_step = step - 1

    def start_loads(self, loads: Mapping[str, GroupBlocks]) -> None:
        with self._lock:
            for request_id, blocks in loads.items():
                job_id = self.store.submit_load(blocks)
                self._jobs[job_id] = self._job(request_id, blocks)
            self._lock.notify_all()

    def start_stores(self, stores: GroupBlocks) -> None:
        if not stores:
            return
        if self._on_cuda:
            # The copies run on our own streams, from our threads: let the forward that
            # wrote these blocks finish first (vLLM syncs at the step's end anyway).
            torch.cuda.current_stream().synchronize()
        with self._lock:
            job_id = self.store.submit_store(stores)
            self._jobs[job_id] = self._job(None, stores)
            self._lock.notify_all()

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose load ended since the last call, and those of them that failed
        (some bytes did not arrive: vLLM recomputes the request)."""
        finished, failed = set(), set()
        with self._lock:
            results, self._results = self._results, []
        for result, job in results:
            failed_blocks = sum(len(ids) for ids in result.failed.values())
            if result.kind == "load":
                finished.add(job.request_id)
                if failed_blocks:
                    failed.add(job.request_id)
                    self._disk_listed_at = 0.0  # a bad file was dropped: re-list soon
                self._stats.record_load(job.num_blocks, job.num_bytes,
                                        job.seconds, failed_blocks)
            elif result.no_room:
                self._stats.record_store(0, 0, 0.0, skipped_blocks=job.num_blocks)
            else:
                self._stats.record_store(job.num_blocks, job.num_bytes, job.seconds,
                                         failed_blocks)
        return finished, failed

    def report(self) -> KVOffloadWorkerMetadata:
        """Keys whose state on this rank changed since the last report (the first report
        lists what the disk tier already holds)."""
        touched: set[OffloadKey] = set()
        with self._lock:
            for event in self.store.manager.take_events():
                if event.kind == "stored":
                    self._host.update(event.keys)
                else:
                    self._host.difference_update(event.keys)
                touched.update(event.keys)
            list_disk = time.monotonic() - self._disk_listed_at >= DISK_INVENTORY_INTERVAL_S
        if list_disk:  # outside the lock: the tier's index has its own
            listed = self.store.storage_keys()
            if listed is not None:
                disk = set(listed)
                touched |= disk ^ self._disk
                self._disk = disk
            self._disk_listed_at = time.monotonic()
        changes = []
        for key in touched:
            state = IN_HOST if key in self._host else ON_DISK if key in self._disk else ABSENT
            old = self._reported.get(key, ABSENT)
            if state != old:
                changes.append((key, old, state))
                if state == ABSENT:
                    del self._reported[key]
                else:
                    self._reported[key] = state
        return KVOffloadWorkerMetadata({self.rank: changes},
                                       {self.rank: self.store.cpu.num_slots},
                                       {self.rank: self._reflected_step})

    def take_stats(self) -> KVOffloadStats | None:
        with self._lock:
            store = self.store
            # Slots in use (O(1); `len(manager)` walks every key).
            host_used = (store.cpu.num_slots - store.manager.num_free_slots) * store.cpu.slot_bytes
            host_total = store.cpu.num_slots * store.cpu.slot_bytes
            disk = store.storage.stats() if store.storage is not None else TierStats()
        self._stats.set_usage(host_used, host_total, disk.bytes_used, disk.bytes_budget,
                              rank=self.rank)
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVOffloadStats()
        return stats

    def reset(self) -> None:
        """Forget everything, host memory and disk files (vLLM resets the connector e.g.
        after a weight update: nothing stored before may be served after)."""
        with self._lock:
            self.store.reset(storage_too=True)
            self._disk_listed_at = 0.0  # report the dropped disk keys at once

    def shutdown(self) -> None:
        """Finish write-through to disk, then stop."""
        if self.store is None:
            return
        self._stop.set()
        if self._pump is not None:
            self._pump.join()
        with self._lock:
            try:
                self.store.flush()
            except Exception:  # never fail vLLM's shutdown: unfinished files are just misses
                logger.exception("kv-offload rank %d: write-through did not finish", self.rank)
            self.store.close()
        self.store = None

    # --- internals ---

    def _job(self, request_id: str | None, blocks: GroupBlocks) -> _Job:
        num_blocks = sum(len(ids) for _, ids in blocks.values())
        num_bytes = sum(len(ids) * self.canonical.data_bytes_per_block(g)
                        for g, (_, ids) in blocks.items())
        return _Job(request_id, time.monotonic(), num_blocks, num_bytes)

    def _run_pump(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                try:
                    done = self.store.poll()
                except Exception:  # a bug must not hang the engine: fail what is in flight
                    logger.exception("kv-offload rank %d: transfer bookkeeping failed; "
                                     "failing the jobs in flight", self.rank)
                    done = [TieredResult(job_id, "store" if job.request_id is None else "load",
                                         False, {-1: [-1]}) for job_id, job in self._jobs.items()]
                now = time.monotonic()
                for result in done:
                    job = self._jobs.pop(result.job_id)
                    job.seconds = now - job.started
                    self._results.append((result, job))
                if done:
                    self._lock.notify_all()
            time.sleep(_PUMP_INTERVAL_S)
