"""The connector's worker side (one per worker rank): moves this rank's shard.

The engine's caches are canonicalised once; a `TieredStore` (host slots in front of the
optional storage tier) does the copies on its own threads, and a pump thread advances it so
write-through keeps going while the engine is idle. Every call from vLLM takes the same
lock, so the store is only ever driven by one thread at a time; under it, each call does
work proportional to what changed in this step (the jobs it submits, the results and key
changes it drains, at most `REPORT_MAX_KEYS` of them).

Nothing here raises into vLLM after start-up. A fault (ours, a tier's, a plug-in's) is
contained where it happens: a load that cannot run is reported failed (vLLM recomputes the
request), a store that cannot run is skipped, the fault is counted in the metrics and logged
once per episode. Every load is reported to vLLM exactly once: the job registry hands a
result over only while the job is registered.

The engine's thread only records what to do (and, on a GPU, an event on its stream); the
pump thread stages the copies and drains results, while a forward runs. From a forward's
end (`start_stores`, after the step's async `start_load_kv`) to the next step's start
(`step_started`) vLLM schedules: the pump leaves it the lock and the GIL, but never for
longer than `_YIELD_TO_ENGINE_S` since its own last round, and not at all while a load is
in flight (else an engine stepping without a forward, its request waiting for our load,
would starve it).

Engine memory is only read by stores and written by loads:
- a store copies blocks the step's forward completed, during the next forward. vLLM may
  free such a block (a finished or preempted request, a sliding window moving on) and hand
  it out again: when the scheduler side sees that happen (`StoreFence`), the metadata says
  `wait_for_stores` and `wait_for_engine_copies` runs before that forward. If a copy is
  not out by `copy_timeout_s` (a stuck thread), the engine goes on and the store is
  abandoned: whatever it copied is discarded, never served;
- a load fills blocks of a request that waits for it (vLLM does not run it, and keeps the
  blocks of an aborted one until the load reports back).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from kv_offload.affinity import spread_threads
from kv_offload.canonical import CanonicalKVCaches, canonicalize
from kv_offload.config import OffloadConfig
from kv_offload.faults import FaultLog
from kv_offload.specs import KVCacheGroup
from kv_offload.tiering import TieredStore, layout_fingerprint
from kv_offload.tiering_jobs import TieredResult
from kv_offload.types import Direction, GroupBlocks, OffloadKey
from kv_offload.vllm.exit_hook import at_interpreter_exit
from kv_offload.vllm.metadata import KVOffloadWorkerMetadata, RankReport, held_bits
from kv_offload.vllm.stats import KVOffloadStats

logger = logging.getLogger(__name__)

REPORT_MAX_KEYS = 8192  # key changes per report: bounds vLLM's IPC per step (inventories too)
# Key changes moved into the next report per pump round / per `report` call: small batches
# keep each hold of the lock (and of Python's GIL) short, so the engine's calls never wait
# long for the pump.
_TAKE_PER_ROUND = 512
_PUMP_INTERVAL_S = 0.002
_YIELD_TO_ENGINE_S = 0.02  # the pump runs at least this often while vLLM schedules
_COPY_POLL_S = 0.0002  # while waiting for engine copies, look for finished ones this often
FLUSH_TIMEOUT_S = 30.0  # at shutdown / exit: the longest we hold the engine for write-through


@dataclass
class _Job:
    request_id: str | None  # loads: the request; stores: None
    step: int  # the plan step that submitted it
    started: float
    num_blocks: int
    num_bytes: int
    abandoned: bool = False  # a store the engine stopped waiting for


@dataclass(frozen=True)
class _Outcome:
    result: TieredResult
    job: _Job
    seconds: float


class OffloadWorker:
    """Worker-side state of the connector for one rank."""

    def __init__(self, config: OffloadConfig, rank: int, fingerprint_extra: str, *,
                 copy_timeout_s: float = 30.0, report_storage_copies: bool = False,
                 engine_pins_threads: bool = False) -> None:
        self.config = config
        # KV events announce a host key's storage copy too: one more report entry per key
        # written through, so only when vLLM publishes events.
        self.report_storage_copies = report_storage_copies
        self.engine_pins_threads = engine_pins_threads  # (vLLM's CPU worker: see affinity.py)
        self.rank, self.fingerprint_extra = rank, fingerprint_extra
        self.copy_timeout_s = copy_timeout_s
        self.canonical: CanonicalKVCaches | None = None
        self.store: TieredStore | None = None
        self.faults = FaultLog(f"kv-offload rank {rank}")
        self._step = -1  # the plan step under way
        self._lock = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._outcomes: list[_Outcome] = []
        self._failed_now: set[str] = set()  # loads that could not even start
        self._stats = KVOffloadStats()
        self._stop = threading.Event()
        self._wake = threading.Event()  # new work for the pump
        self._forward_ended: float | None = None  # the engine is between two forwards
        self._loads_in_flight = 0  # requests wait for them: no yield (read without the lock)
        self._pump: threading.Thread | None = None
        # Key changes the pump took from the store ahead of the next report, as the report's
        # columns, so `report` on the engine's step path only hands them over (bounded by
        # REPORT_MAX_KEYS).
        self._report_keys: list[OffloadKey] = []
        self._report_held, self._report_reset = bytearray(), False

    def register(self, kv_caches: Mapping[str, torch.Tensor], groups: list[KVCacheGroup],
                 num_blocks: int) -> None:
        """Canonicalise the engine's caches and open the tiers (errors here are start-up
        configuration errors and do raise)."""
        self.canonical = canonicalize(kv_caches, groups, num_blocks)
        fingerprint = layout_fingerprint(self.canonical, self.fingerprint_extra)
        with spread_threads(self.engine_pins_threads):  # off the forward's cores
            self.store = TieredStore.from_config(
                self.canonical, self.config, fingerprint,
                report_storage_copies=self.report_storage_copies)
            self._pump = threading.Thread(target=self._run_pump, daemon=True,
                                          name=f"kv-offload-pump-{self.rank}")
            self._pump.start()
        at_interpreter_exit(weakref.WeakMethod(self._flush_at_exit))

    # --- per step, in vLLM's order ---

    def wait_for_engine_copies(self, timeout_s: float | None = None) -> None:
        """Block until every store submitted so far has copied its engine blocks out; past
        the timeout, abandon the stragglers instead (the engine must go on)."""
        timeout_s = self.copy_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while stragglers := self._stragglers():
                # Collect finished copies here, not at the pump's next round (it sleeps
                # between rounds): the copies are usually out by the time we look.
                self._pump_once()
                if not (stragglers := self._stragglers()):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    self.faults.failed("engine copy", f"{len(stragglers)} store(s) not copied "
                                       f"out of engine memory within {timeout_s} s")
                    self._abandon(stragglers)
                    return
                self._lock.wait(timeout=min(_COPY_POLL_S, left))
        self.faults.succeeded("engine copy")

    def _reflected_step(self) -> int:
        """Lock held: the last plan step whose stores have all been copied out of engine
        memory, so their keys show in the changes taken so far. O(stores in flight)."""
        in_flight = [job.step for job in self._jobs.values() if job.request_id is None]
        return min(in_flight) - 1 if in_flight else self._step

    def _stragglers(self) -> list[int]:
        """Lock held: stores whose copy out of engine memory may still run."""
        return [job_id for job_id, job in self._jobs.items()
                if job.request_id is None and not job.abandoned]

    def step_started(self) -> None:
        """A step's execution begins (vLLM's `handle_preemptions`, before any forward): the
        engine stops scheduling, the pump runs freely again."""
        self._forward_ended = None
        self._wake.set()

    def begin_step(self, step: int) -> None:
        """A new step's plans arrived."""
        self._step = step

    def start_loads(self, loads: Mapping[str, GroupBlocks], failed: Collection[str] = ()
                    ) -> None:
        """Start this step's loads; `failed`: loads the scheduler could not plan."""
        with self._lock:
            self._failed_now.update(failed)
            # GPU: one event on the engine's stream orders every copy of these loads after
            # vLLM's own work on their blocks (e.g. zeroing new blocks); no host wait.
            ready = self.store.engine_ready() if loads else None
            for request_id, blocks in loads.items():
                try:
                    job_id = self.store.submit_load(blocks, ready)
                    self._jobs[job_id] = self._job(request_id, blocks)
                    self._loads_in_flight += 1
                except Exception as exc:
                    self.faults.failed("load submit", exc)
                    self._failed_now.add(request_id)
            self._lock.notify_all()
        self._wake.set()

    def fail_loads(self, request_ids: Collection[str]) -> None:
        """Report these loads failed at the next `finished_loads` without starting them
        (a recovery path: it only records ids)."""
        with self._lock:
            self._failed_now.update(request_ids)

    def start_stores(self, stores: GroupBlocks) -> None:
        """Copy out the blocks this step's forward completed (the pump stages them, in the
        next forward: the engine is now scheduling the next step)."""
        self._forward_ended = time.monotonic()
        if not stores:
            return
        try:
            with self._lock:
                # GPU: our copy stream waits on an event recorded on the engine's stream
                # after the forward that wrote these blocks; the CPU does not wait.
                job_id = self.store.submit_store(stores, self.store.engine_ready())
                self._jobs[job_id] = self._job(None, stores)
                self._lock.notify_all()
        except Exception as exc:
            self.faults.failed("store submit", exc)

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose load ended since the last call, and those of them that failed
        (some bytes did not arrive: vLLM recomputes the request). Each request once."""
        with self._lock:
            outcomes, self._outcomes = self._outcomes, []
            failed_now, self._failed_now = self._failed_now, set()
        finished, failed = set(failed_now), set(failed_now)
        for outcome in outcomes:
            result, job = outcome.result, outcome.job
            failed_blocks = sum(len(ids) for ids in result.failed.values())
            if result.direction is Direction.LOAD:
                finished.add(job.request_id)
                if not result.success:
                    failed.add(job.request_id)
                self._stats.record_load(job.num_blocks, job.num_bytes, outcome.seconds,
                                        failed_blocks)
            else:
                # (`skipped` counts keys: the same as blocks unless a key was listed twice)
                skipped = min(job.num_blocks, result.skipped)
                stored = job.num_blocks - skipped
                self._stats.record_store(stored, job.num_bytes * stored // max(1, job.num_blocks),
                                         outcome.seconds, max(0, failed_blocks - skipped),
                                         skipped_blocks=skipped)
        return finished, failed

    def report(self) -> KVOffloadWorkerMetadata:
        """Keys whose location on this rank changed since the last report (at most
        `REPORT_MAX_KEYS`; an inventory found at start-up streams over several steps)."""
        with self._lock:
            try:
                self._take_changes()  # (what arrived since the pump's last round: a few)
            except Exception as exc:  # report what was taken; the rest stays pending
                self.faults.failed("report", exc)
            report = RankReport(tuple(self._report_keys), bytes(self._report_held),
                                self._report_reset, self._reflected_step())
            self._clear_report(reset=False)
        return KVOffloadWorkerMetadata({self.rank: report})

    def take_stats(self) -> KVOffloadStats | None:
        with self._lock:
            usage = self.store.usage()
            tier_faults = self.store.take_fault_counts()
            key_failures = self.store.take_key_failures()
        faults = self.faults.take_counts()
        self._stats.record_faults(worker=sum(faults.values()) + sum(tier_faults.values()))
        self._stats.record_storage_failures(key_failures.get(Direction.LOAD, 0),
                                            key_failures.get(Direction.STORE, 0))
        self._stats.set_usage(usage.host_bytes_used, usage.host_bytes_total,
                              usage.storage.bytes_used, usage.storage.bytes_budget,
                              rank=self.rank)
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVOffloadStats()
        return stats

    def reset(self) -> None:
        """Forget everything (vLLM resets the connector e.g. after a weight update: nothing
        stored before may be served after). O(host keys); no file is touched."""
        with self._lock:
            self.store.reset()

    def shutdown(self) -> None:
        """Finish write-through, then stop. Never raises."""
        if self.store is None:
            return
        self._stop.set()
        self._wake.set()
        if self._pump is not None:
            self._pump.join()
        with self._lock:
            try:
                if not self.store.flush(FLUSH_TIMEOUT_S):
                    logger.warning("kv-offload rank %d: write-through did not finish before "
                                   "shutdown; unfinished keys are misses", self.rank)
                self.store.close()
            except Exception:  # never fail vLLM's shutdown: unfinished files are just misses
                logger.exception("kv-offload rank %d: shutdown of the tiers failed", self.rank)
        self.store = None

    def _flush_at_exit(self) -> None:
        """The interpreter is exiting (an offline `LLM` script ended without shutting vLLM
        down; vLLM then shuts the engine down from a finalizer, after Python has stopped
        every thread pool: the tiers could no longer write). Finish write-through now;
        vLLM's shutdown, if it comes, finds nothing left to write. Never raises."""
        with self._lock:
            if self.store is None:
                return
            try:
                if not self.store.flush(FLUSH_TIMEOUT_S):
                    logger.warning("kv-offload rank %d: write-through did not finish before "
                                   "the process exit; unfinished keys are misses", self.rank)
            except Exception:
                logger.exception("kv-offload rank %d: write-through at exit failed", self.rank)

    # --- internals ---

    def _job(self, request_id: str | None, blocks: GroupBlocks) -> _Job:
        num_blocks = sum(len(ids) for _, ids in blocks.values())
        num_bytes = sum(len(ids) * self.canonical.data_bytes_per_block(g)
                        for g, (_, ids) in blocks.items())
        return _Job(request_id, self._step, time.monotonic(), num_blocks, num_bytes)

    def abandon_stores(self) -> None:
        """The engine goes on without waiting for the stores in flight (e.g. the wait
        itself failed): their copies are discarded when they end, never served."""
        with self._lock:
            self._abandon([job_id for job_id, job in self._jobs.items()
                           if job.request_id is None and not job.abandoned])

    def _abandon(self, job_ids: list[int]) -> None:
        """Lock held: stop waiting for these stores; their copies are discarded."""
        for job_id in job_ids:
            self._jobs[job_id].abandoned = True
        for job_id in job_ids:
            self.store.abandon_store(job_id)

    def _deliver(self, results: list[TieredResult]) -> None:
        """Lock held: hand each job's result over once (an unknown id was delivered)."""
        now = time.monotonic()
        for result in results:
            job = self._jobs.pop(result.job_id, None)
            if job is not None:
                self._outcomes.append(_Outcome(result, job, now - job.started))
                self._loads_in_flight -= job.request_id is not None
        if results:
            self._lock.notify_all()

    def _run_pump(self) -> None:
        """Advance the store until shutdown. Nothing can end this loop but `_stop`: a fault
        in one round is contained and the next round runs."""
        last_round = 0.0
        while not self._stop.is_set():
            self._wake.wait(_PUMP_INTERVAL_S)
            self._wake.clear()
            now, ended = time.monotonic(), self._forward_ended
            if not self._loads_in_flight and ended is not None and \
                    now - ended < _YIELD_TO_ENGINE_S and now - last_round < _YIELD_TO_ENGINE_S:
                continue  # the engine is scheduling its next step: leave it the CPU
            last_round = now
            with self._lock:
                self._pump_once()
                try:
                    self._take_changes()
                except Exception as exc:
                    self.faults.failed("report", exc)

    def _pump_once(self) -> None:
        """Lock held: one round of advancing the store (a fault is contained)."""
        try:
            self._deliver(self.store.poll())
            self.faults.succeeded("pump")
        except Exception as exc:
            self.faults.failed("pump", exc)

    def _take_changes(self) -> None:
        """Lock held: move key changes from the store into the next report (bounded)."""
        room = min(_TAKE_PER_ROUND, REPORT_MAX_KEYS - len(self._report_keys))
        if room <= 0:
            return
        batch = self.store.take_changes(room)
        if batch.reset:  # what was taken before the reset is moot
            self._clear_report(reset=True)
        self._report_keys.extend(change.key for change in batch.changes)
        self._report_held.extend(map(held_bits, batch.changes))

    def _clear_report(self, *, reset: bool) -> None:
        self._report_keys, self._report_held, self._report_reset = [], bytearray(), reset
