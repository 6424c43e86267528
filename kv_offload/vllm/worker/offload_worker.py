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
pump thread (`pump.py`: when it runs and when it leaves the engine the CPU) stages the
copies and drains results, while a forward runs.

The worker owns its parts: the pump, the layer-wise plan (`layers.py`: vLLM's per-layer
hooks), what it owes vLLM about loads that did not arrive (`load_reports.py`: by request or,
for in-step loads, by block) and its job records (`jobs.py`). Its own methods are vLLM's
calls, in vLLM's order, then sleep mode and shutdown; each takes the lock and drives the
store, the parts only keep their books.

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
from collections.abc import Callable, Collection, Mapping, Sequence

import torch
import xxhash

from kv_offload.backends import storage_choice
from kv_offload.canonical import CanonicalKVCaches, canonicalize
from kv_offload.config import OffloadConfig
from kv_offload.runtime.affinity import spread_threads
from kv_offload.runtime.faults import FaultLog
from kv_offload.specs import KVCacheGroup
from kv_offload.store.host.layer_copies import LayerSteps
from kv_offload.store.jobs import TieredResult
from kv_offload.store.tiered import TieredStore, layout_fingerprint
from kv_offload.store.tp.records import TPShare, rank_records
from kv_offload.types import Direction, GroupBlocks, OffloadKey
from kv_offload.vllm.metadata import KVOffloadWorkerMetadata, RankReport, held_bits
from kv_offload.vllm.stats import HOST, KVOffloadStats
from kv_offload.vllm.worker.exit_hook import at_interpreter_exit
from kv_offload.vllm.worker.finder import Finder
from kv_offload.vllm.worker.jobs import Job, Outcome, record_outcome
from kv_offload.vllm.worker.layers import LayerPlan
from kv_offload.vllm.worker.load_reports import LoadReports
from kv_offload.vllm.worker.pump import Pump

logger = logging.getLogger(__name__)

REPORT_MAX_KEYS = 8192  # key changes per report: bounds vLLM's IPC per step (inventories too)
# Key changes moved into the next report per pump round / `report` call: small batches keep
# each hold of the lock (and the GIL) short; the engine's calls never wait long for the pump.
_TAKE_PER_ROUND = 512
_COPY_POLL_S = 0.0002  # while waiting for engine copies, look for finished ones this often
# A step without a forward waits at most this long for an asynchronous load to land. vLLM
# steps without pause while its only requests wait for our loads: that engine thread, all
# Python, held the GIL and a core, and our reads and copies (threads that need the GIL
# between system calls) ran 3 to 5x slower than inside a step (a 16 MiB disk hit: 60 to
# 150 ms of reads instead of 25). Waiting here hands both over; a load that lands ends the
# wait at once, and a request arriving meanwhile waits at most this long to be scheduled.
IDLE_WAIT_S = 0.005
FLUSH_TIMEOUT_S = 30.0  # at shutdown / exit: the longest we hold the engine for write-through


class OffloadWorker:
    """Worker-side state of the connector for one rank."""

    def __init__(self, config: OffloadConfig, rank: int, fingerprint_extra: str, *,
                 tp_share: TPShare | None = None,
                 report_storage_copies: bool = False,
                 engine_pins_threads: bool = False) -> None:
        self.config = config
        choice = storage_choice(config)
        self._storage_label = choice.label if choice is not None else None
        # KV events announce storage copies too (a report entry per key): only if published.
        self.report_storage_copies = report_storage_copies
        # (vLLM's CPU worker: see runtime/affinity.py)
        self.engine_pins_threads = engine_pins_threads
        self.rank, self.fingerprint_extra = rank, fingerprint_extra
        # TP-free records in the storage tier (None: this rank's own namespace, as a tool
        # or test without a TP identity opens it).
        self.tp_share = tp_share
        self.copy_timeout_s = config.copy_timeout_s
        self.canonical: CanonicalKVCaches | None = None
        self.store: TieredStore | None = None
        self.faults = FaultLog(f"kv-offload rank {rank}")
        self._step = -1  # the plan step under way
        # The last plan step whose stores were handed to the store (`start_stores`). With a
        # drafter vLLM reports (`report`) before it submits the step's stores, so "no store
        # in flight" alone does not mean the step's stores are out of engine memory.
        self._stores_submitted = -1
        self._lock = threading.Condition()
        self._jobs: dict[int, Job] = {}
        self._outcomes: list[Outcome] = []
        self.reports = LoadReports()  # failed loads by request or block, given-up loads
        # This step's in-step blocks: all reported failed if the errors cannot be taken.
        self.in_step_blocks: set[int] = set()
        self._stats = KVOffloadStats()
        self._loads_in_flight = 0  # requests wait for them: no yield (read without the lock)
        self._suspended = False  # vLLM's sleep mode unmapped engine memory: touch none of it
        self._pump: Pump | None = None
        self._finder: Finder | None = None  # (set up at `register`)
        self._found_ready = -1  # the last plan step whose `find` keys the finder asked for
        self._found_through = -1  # ... and whose answers a report has taken in
        self.identity = ""  # (the TP-free namespace's fingerprint, hashed: at `register`)
        # Key changes the pump took ahead of the next report, as the report's columns, so
        # `report` on the step path only hands them over (bounded by REPORT_MAX_KEYS).
        self._report_keys: list[OffloadKey] = []
        self._report_held, self._report_reset = bytearray(), False
        self.layers = LayerPlan()  # set up at `register`

    @property
    def layer_wise(self) -> bool:
        """Whether in-step loads and stores go a layer at a time on this rank."""
        return self.layers.enabled

    def register(self, kv_caches: Mapping[str, torch.Tensor], groups: list[KVCacheGroup],
                 num_blocks: int, fingerprint_extra: str | None = None,
                 tp_share: TPShare | None = None, identity: str | None = None) -> None:
        """Canonicalise the engine's caches and open the tiers (errors here are start-up
        configuration errors and do raise). ``fingerprint_extra`` and ``tp_share``, where
        given, replace the constructor's: the connector knows them only now, once the
        weights are identified. ``identity`` (what the weights were identified by) ends the
        rank's start-up line."""
        if fingerprint_extra is not None:
            self.fingerprint_extra, self.tp_share = fingerprint_extra, tp_share
        self.canonical = canonicalize(kv_caches, groups, num_blocks)
        fingerprint = layout_fingerprint(self.canonical, self.fingerprint_extra)
        records = None if self.tp_share is None else rank_records(
            self.canonical, kv_caches, groups, self.tp_share, fingerprint)
        with spread_threads(self.engine_pins_threads):  # off the forward's cores
            self.store = TieredStore.from_config(
                self.canonical, self.config, fingerprint, records=records,
                report_storage_copies=self.report_storage_copies)
            copies = self.layers.setup(self.config.layer_wise, self.canonical,
                                       [group.spec for group in groups],
                                       self.store.cpu.layer_copier)
            logger.info("kv-offload rank %d: %s; %s%s", self.rank, self.store.describe(),
                        copies, f"; {identity}" if identity else "")
            self._pump = Pump(self._pump_round, lambda: self._loads_in_flight,
                              lambda: bool(self._jobs) or self.store.busy(),
                              f"kv-offload-pump-{self.rank}")
            self._pump.start()
            # (`self.store`, not the store now: a test may wrap it after `register`)
            self._finder = Finder(self._keys_to_find,
                                  lambda names: self.store.find_in_storage(names),
                                  self._found, self.faults, f"kv-offload-find-{self.rank}",
                                  idle=self._settle_generation)
            share = self.tp_share.shared_extra if self.tp_share is not None else fingerprint
            self.identity = xxhash.xxh3_64_hexdigest(share.encode())
        at_interpreter_exit(weakref.WeakMethod(self._flush_at_exit))

    # --- per step, in vLLM's order ---

    def wait_for_engine_copies(self, timeout_s: float | None = None) -> None:
        """Block until every store submitted so far has copied its engine blocks out; past
        the timeout, abandon the stragglers instead (the engine must go on)."""
        timeout_s = self.copy_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if not self._drive_until(lambda: not self._stragglers(), timeout_s):
                stragglers = self._stragglers()
                self.faults.failed("engine copy", f"{len(stragglers)} store(s) not copied "
                                   f"out of engine memory within {timeout_s} s")
                self._abandon(stragglers)
                return
        self.faults.succeeded("engine copy")

    def _drive_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Lock held: advance the store here (not at the pump's next round: it sleeps
        between rounds, and copies are usually out by the time we look) until `done()`, at
        most `timeout_s`. Whether it is done."""
        deadline = time.monotonic() + timeout_s
        while not done():
            self._pump_once()
            left = deadline - time.monotonic()
            if done() or left <= 0:
                return done()
            self._lock.wait(timeout=min(_COPY_POLL_S, left))
        return True

    def _reflected_step(self) -> int:
        """Lock held: the last plan step whose stores have all been copied out of engine
        memory, so their keys show in the changes taken so far. O(stores in flight).

        Only what was submitted can have been copied: a step whose stores vLLM has not yet
        handed over (`report` before `wait_for_save`, as with a drafter) is not reflected,
        whatever the order of the calls."""
        in_flight = [job.step for job in self._jobs.values() if job.request_id is None]
        return min(in_flight) - 1 if in_flight else self._stores_submitted

    def _stragglers(self) -> list[int]:  # lock held: stores that may still read the engine
        return [job_id for job_id, job in self._jobs.items()
                if job.request_id is None and not job.abandoned]

    def step_started(self) -> None:
        """A step begins (vLLM's `handle_preemptions`, before any forward): the engine stops
        scheduling, the pump runs freely again."""
        self._pump.step_started()
        with self._lock:  # (the last forward's, if its wait_for_save never came)
            self.layers.release_store()
            self._end_layer_loads()

    def begin_step(self, step: int) -> None:  # a new step's plans arrived
        self._step = step

    def find(self, keys: Sequence[OffloadKey]) -> None:
        """Keys waiting requests need and no rank reported: ask the storage tier for them
        (on the finder's thread; what it holds comes back in a later report, with
        `found_through` at this step)."""
        if self._finder is not None:
            self._finder.ask(self._step, keys)

    def _keys_to_find(self, keys: Sequence[OffloadKey]) -> list[bytes]:
        # Without the lock: an idle engine steps in a busy loop that takes it again and
        # again, and the finder would wait behind it. Reads only; a stale answer asks the
        # tier about a key it is already known to hold, which costs one question.
        store = self.store
        return [] if store is None else store.keys_to_find(keys)

    def _settle_generation(self) -> None:
        """The finder's idle call: join the fleet's key generation once the storage tier
        answers, if it could not be reached at start (I/O without the lock)."""
        store = self.store
        if store is None or not store.generation_unsettled:
            return
        fleet = store.read_fleet_generation()  # (I/O and the listing: without the lock)
        if fleet is not None:
            with self._lock:
                if self.store is not None:
                    self.store.settle_generation(fleet)

    def _found(self, step: int) -> None:
        """The finder asked the tier for the keys of `step`: the next report takes in what
        the tier adopted, then says so (`report`; no lock here, for the same reason)."""
        self._found_ready = max(self._found_ready, step)

    def protect(self, keys: Sequence[OffloadKey]) -> None:
        """Keys of the hits the scheduler's lookups found: the tiers keep them longer."""
        with self._lock:
            self.store.protect(keys)

    def start_loads(self, loads: Mapping[str, GroupBlocks], failed: Collection[str] = (),
                    in_step: Collection[str] = (), failed_blocks: Collection[int] = ()
                    ) -> None:
        """Start this step's loads; `failed`: loads the scheduler could not plan; `in_step`:
        loads finished before returning, or layer-wise before each layer's forward
        (worker/layers.py): vLLM runs their requests in this step. Their blocks that did not
        arrive, and `failed_blocks` (unplanned in-step loads), go to `take_block_errors`."""
        deadline = time.monotonic() + self.copy_timeout_s  # (in-step: one bound per step)
        with self._lock:
            self.reports.fail(failed, failed_blocks=failed_blocks)
            self.in_step_blocks = {i for r in in_step for _, ids in loads[r].values()
                                   for i in ids} | set(failed_blocks)
            if self._suspended:  # (vLLM pauses before it sleeps: a recovery path)
                self.reports.fail(loads, in_step, loads)
                return
            # GPU: one event on the engine's stream orders every copy of these loads after
            # vLLM's own work on their blocks (e.g. zeroing new blocks); no host wait.
            ready = self.store.engine_ready() if loads else None
            for request_id, blocks in loads.items():
                layers = self._layer_steps_for_load() if request_id in in_step else None
                try:
                    # (an in-step load copied whole: by the thread that waits for it)
                    job_id = self.store.submit_load(blocks, ready, layers,
                                                    inline=request_id in in_step and layers is None)
                    self._jobs[job_id] = job = self._job(request_id, blocks,
                                                         request_id in in_step, layers)
                    self._loads_in_flight += 1
                    if layers is not None:
                        self.layers.loads.append(job)
                except Exception as exc:
                    self.faults.failed("load submit", exc)
                    self.reports.fail([request_id], in_step, loads)
            self._lock.notify_all()
            if self.layers.loads:
                self._pump_once()  # planned now: the copies start before the forward does
            elif in_step:
                self._finish_in_step_loads(deadline - time.monotonic())
        self._pump.wake()

    def _layer_steps_for_load(self) -> LayerSteps | None:
        return self.layers.steps_for_load()

    def _finish_in_step_loads(self, timeout_s: float | None = None) -> None:
        """Lock held: drive the store until this step's in-step loads ended (their copies
        are all in engine memory), at most `timeout_s` (default `copy_timeout_s`); past it,
        their blocks are reported failed and the loads given up (a stuck thread: the fault
        log): no further copy of theirs starts, so vLLM's recompute of those blocks is not
        overwritten later, and their late results are ignored (`load_reports.py`)."""
        timeout_s = self.copy_timeout_s if timeout_s is None else max(0.0, timeout_s)
        if self._drive_until(lambda: not any(j.in_step for j in self._jobs.values()),
                             timeout_s):
            return
        late = [job_id for job_id, job in self._jobs.items() if job.in_step]
        self.faults.failed("in-step load", f"{len(late)} load(s) not done within "
                           f"{self.copy_timeout_s} s; recomputed")
        for job_id in late:
            job = self._jobs.pop(job_id)
            self.reports.fail_blocks(job.block_ids)  # (first: abandoning may fail)
            self._loads_in_flight -= 1
            self.store.abandon_load(job_id)
            self.reports.give_up(job_id, job)

    # --- vLLM's per-layer hooks (layers.py) ---

    def wait_for_layer(self, layer_name: str) -> None:
        """Return once `layer_name`'s bytes of every in-step load are in engine memory
        (or its load ended); past `copy_timeout_s` the stragglers are failed (recomputed)."""
        if not self.layers.loads:  # (most steps: no lock taken)
            return
        with self._lock:
            if not self.layers.loads:
                return
            layer = self.layers.index_of(layer_name)
            if layer is None:  # a name we do not cut by (e.g. a KV-sharing layer): all
                self._finish_in_step_loads()
                return
            self.layers.waited(layer)
            if not self._drive_until(lambda: all(job.layers.copied(layer) for job in
                                                 self._jobs.values() if job.layers is not None),
                                     self.copy_timeout_s):
                self._finish_in_step_loads(timeout_s=0.0)  # the stragglers: recomputed

    def layer_saved(self, layer_name: str, stores: GroupBlocks, step: int) -> None:
        """The forward of plan step `step` is done with `layer_name`: copy its blocks of the
        step's `stores` out now (the store is submitted, gated, at the step's first call;
        vLLM may call `start_load_kv` only after the forward)."""
        if not self.layer_wise or not stores:
            return
        layer = self.layers.index_of(layer_name)
        with self._lock:
            steps = self.layers.store_steps(step)
            self._step = step
            if steps is None:
                if self._suspended:
                    return
                steps = self.layers.new_store(step)
                try:
                    job_id = self.store.submit_store(stores, self.store.engine_ready(), steps)
                except Exception as exc:  # skipped; wait_for_save does not submit it again
                    self.faults.failed("store submit", exc)
                    steps.open_all()
                    return
                self._jobs[job_id] = self._job(None, stores)
                self._lock.notify_all()
            if layer is not None:
                steps.open(layer)
        self._pump.wake()

    def fail_layer_loads(self) -> None:
        """A recovery path: every block of this step's layer-wise loads is a load error."""
        with self._lock:
            for job in self.layers.loads:
                self.reports.fail_blocks(job.block_ids)

    def store_layers_copied(self) -> int:
        """Layers of this step's layer-wise store copied out so far (0 without one)."""
        return self.layers.store_layers_copied()

    def _end_layer_loads(self) -> None:
        """Lock held, after the forward (`wait_for_save` or `get_block_ids_with_load_errors`,
        whichever vLLM calls first): finish this step's layer-wise loads; if the forward
        skipped the hook of a layer, every block of them is a load error."""
        if not self.layers.loads:
            return
        jobs, skipped = self.layers.end_loads()
        self._finish_in_step_loads()
        if skipped:
            self.faults.failed("layer-wise load", f"the forward did not wait for {skipped} "
                               "layer(s); their loads are recomputed")
            for job in jobs:
                self.reports.fail_blocks(job.block_ids)
        else:
            self.faults.succeeded("layer-wise load")

    # --- loads that did not arrive (load_reports.py) ---

    def wait_for_given_up_loads(self) -> None:
        """Before a forward: block until no in-step load given up on this rank still runs
        (`KVOffloadMetadata.wait_for_loads`: vLLM handed a block one of them may write to
        another request). Without a bound, unlike every other wait here: going on could put
        one request's bytes into another's blocks. Each `copy_timeout_s` passed is a fault
        (counted, logged once per episode)."""
        with self._lock:
            while not self._drive_until(lambda: not self.reports.any_given_up,
                                        self.copy_timeout_s):
                self.faults.failed("given-up load", f"the forward waits for "
                                   f"{self.reports.num_given_up} given-up load(s) still "
                                   "copying into blocks vLLM handed to another request")

    def hold_for_copies(self, request_ids: Collection[str]) -> None:
        """vLLM keeps the blocks of these finished requests (`KVOffloadMetadata.held`):
        report each back in `finished_loads` once no given-up copy of it runs on this rank,
        at once where none does."""
        if not request_ids:
            return
        with self._lock:
            self.reports.hold(request_ids)

    def fail_loads(self, request_ids: Collection[str], in_step: Collection[str] = (),
                   loads: Mapping[str, GroupBlocks] | None = None,
                   failed_blocks: Collection[int] = ()) -> None:
        """Report these loads failed without starting them (a recovery path: it only
        records): by request at the next `finished_loads`, or, for in-step loads (whose
        requests vLLM runs in this step), by their blocks in `loads` (and `failed_blocks`)."""
        with self._lock:
            self.reports.fail(request_ids, in_step, loads, failed_blocks)

    def take_block_errors(self) -> set[int]:
        """Engine blocks of in-step loads that did not arrive since the last call (vLLM
        recomputes them, right after the forward that read them)."""
        with self._lock:
            self._end_layer_loads()  # (after the forward: layer-wise loads end here at last)
            return self.reports.take_block_errors()

    def start_stores(self, stores: GroupBlocks) -> None:
        """Copy out the blocks this step's forward completed (the pump stages them, in the
        next forward: the engine is now scheduling the next step)."""
        self._pump.forward_ended()
        with self._lock:
            self._end_layer_loads()
            try:
                # (a store cut per layer was submitted at the first save_kv_layer)
                if not self.layers.release_store() and stores and not self._suspended:
                    # GPU: our copy stream waits on an event recorded on the engine's stream
                    # after the forward that wrote these blocks; the CPU does not wait.
                    job_id = self.store.submit_store(stores, self.store.engine_ready())
                    self._jobs[job_id] = self._job(None, stores)
                    self._lock.notify_all()
            except Exception as exc:  # skipped: nothing of this step reads engine memory
                self.faults.failed("store submit", exc)
            self._stores_submitted = self._step
        self._pump.wake()  # (it sleeps longer while idle)

    def finished_loads(self, idle: bool = False) -> tuple[set[str], set[str]]:
        """Requests whose load ended since the last call, and those of them that failed
        (some bytes did not arrive: vLLM recomputes the request). Each request once.
        `idle`: this step ran no forward; with a load in flight and none ended yet, drive
        the store here until one ends, at most `IDLE_WAIT_S` (see there)."""
        with self._lock:
            if idle and self._loads_in_flight and not self.reports.any_failed_now:
                self._drive_until(self._a_load_ended, IDLE_WAIT_S)
            outcomes, self._outcomes = self._outcomes, []
            failed_now, released = self.reports.take_finished()
        finished, failed = set(failed_now) | released, set(failed_now)
        for outcome in outcomes:
            record_outcome(outcome, self._stats)
            job = outcome.job
            if outcome.result.direction is Direction.LOAD and not job.in_step:
                finished.add(job.request_id)  # (in-step loads: reported as block errors)
                if not outcome.result.success:
                    failed.add(job.request_id)
        return finished, failed

    def _a_load_ended(self) -> bool:  # lock held: O(outcomes since the last step)
        return not self._loads_in_flight or \
            any(o.job.request_id is not None for o in self._outcomes)

    def report(self) -> KVOffloadWorkerMetadata:
        """Keys whose location on this rank changed since the last report (at most
        `REPORT_MAX_KEYS`; an inventory found at start-up streams over several steps)."""
        with self._lock:
            try:
                ready = self._found_ready
                if ready > self._found_through:  # (what the finder found: one batch)
                    self.store.absorb_storage_changes()
                    self._found_through = ready
                self._take_changes()  # (what arrived since the pump's last round: a few)
            except Exception as exc:  # report what was taken; the rest stays pending
                self.faults.failed("report", exc)
            report = RankReport(tuple(self._report_keys), bytes(self._report_held),
                                self._report_reset, self._reflected_step(),
                                self.store.read_rate.bytes_per_s,
                                self.reports.given_up_requests(), self._step,
                                self._found_through, self.identity)
            self._clear_report(reset=False)
        return KVOffloadWorkerMetadata({self.rank: report})

    def take_stats(self) -> KVOffloadStats | None:
        with self._lock:
            usage = self.store.usage()
            tier_faults = self.store.take_fault_counts()
            failed, rejected = self.store.take_key_failures(), self.store.take_rejected(usage)
            written = self.store.take_written(usage)
        faults = self.faults.take_counts()
        self._stats.record_faults(worker=sum(faults.values()) + sum(tier_faults.values()))
        self._stats.record_storage_failures(failed.get(Direction.LOAD, 0),
                                            failed.get(Direction.STORE, 0), rejected)
        self._stats.record_storage_writes(written.page_bytes, written.record_bytes)
        self._stats.set_usage(HOST, usage.host_bytes_used, usage.host_bytes_total,
                              rank=self.rank)
        if self._storage_label is not None:
            storage = usage.storage
            self._stats.set_usage(self._storage_label, storage.bytes_used, storage.bytes_budget,
                                  servers_down=storage["servers_down"], rank=self.rank)
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVOffloadStats()
        return stats

    def reset(self) -> None:
        """Forget everything (vLLM resets the connector e.g. after a weight update: nothing
        stored before may be served after). O(host keys); no file is touched."""
        with self._lock:
            self.store.reset()

    # --- sleep mode, shutdown, the interpreter's exit ---
    # Sleep mode (vLLM >= 0.33) unmaps engine memory: `suspend` lets every copy out of it
    # and every load into it end first (bounded by `copy_timeout_s`), then loads fail and
    # stores are skipped until `resume`; write-through from host memory goes on. `shutdown`
    # and `_flush_at_exit` finish write-through (bounded by `FLUSH_TIMEOUT_S`) and never
    # raise: a key whose write did not finish is a miss later, never a failed shutdown.

    def suspend(self) -> None:
        """vLLM is about to unmap engine memory (sleep mode, vLLM >= 0.33): copies out of it
        end first (past `copy_timeout_s` abandoned), so do loads filling it (bounded alike);
        until `resume`, loads fail and stores are skipped. Write-through from host memory
        goes on. Idempotent."""
        with self._lock:
            self._suspended = True
        self.wait_for_engine_copies()
        with self._lock:
            if not self._drive_until(lambda: not self._loads_in_flight, self.copy_timeout_s):
                self.faults.failed("sleep", f"{self._loads_in_flight} load(s) still filling "
                                   f"engine memory after {self.copy_timeout_s} s; given up")
                for job_id, job in self._jobs.items():  # (no further copy into that memory)
                    if job.request_id is not None:
                        self.store.abandon_load(job_id)

    def resume(self) -> None:
        """Engine memory is mapped again: loads and stores run again (the tiers kept their
        KV: hits after a wake-up are served from them). Idempotent."""
        with self._lock:
            self._suspended = False

    def shutdown(self) -> None:
        """Finish write-through, then stop. Never raises."""
        if self.store is None:
            return
        if self._pump is not None:
            self._pump.stop()
        if self._finder is not None:
            self._finder.stop()
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

    def _job(self, request_id: str | None, blocks: GroupBlocks, in_step: bool = False,
             layers: LayerSteps | None = None) -> Job:
        num_blocks = sum(len(ids) for _, ids in blocks.values())
        num_bytes = sum(len(ids) * self.canonical.data_bytes_per_block(g)
                        for g, (_, ids) in blocks.items())
        block_ids = [i for _, ids in blocks.values() for i in ids] if in_step else []
        return Job(request_id, self._step, time.monotonic(), num_blocks, num_bytes,
                   in_step=in_step, block_ids=block_ids, layers=layers)

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
            self.reports.ended(result.job_id)  # (nothing of it runs now)
            job = self._jobs.pop(result.job_id, None)
            if job is not None:
                self._outcomes.append(Outcome(result, job, now - job.started))
                self._loads_in_flight -= job.request_id is not None
                if job.in_step:  # (its request runs in this step: failures by block)
                    self.reports.fail_blocks([i for ids in result.failed.values()
                                              for i in ids])
        if results:
            self._lock.notify_all()

    def _pump_round(self) -> None:
        """One round of the pump thread (never raises: faults are contained)."""
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
