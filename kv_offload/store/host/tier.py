"""HostTier: the primary tier, engine blocks <-> host-memory slots, asynchronously.

One slot holds one block of one cache group (layout: kv_offload/kernels/geometry.py). The
scheduler-side manager hands out slot ids in `[0, num_slots)`; this class only
moves bytes. Jobs run on two worker threads, one for stores and one for loads,
so a load never queues behind a long store; jobs of one direction run in
submission order. Nothing orders a store against a load: the caller must not
load a slot before the store into it has finished (the manager's rule anyway).
An *inline* job (an in-step load, whose caller would only wait for it) is planned
and copied on the calling thread on CPU engines, beside the queue: one thread
hand-off less on the engine's step path; on a GPU it is queued like any other.

A CPU copy is bounded (`copy_timeout_s`; `cancel`: its caller's own bound): past it no
further op starts, yet the job ends only once the op still running has. A result means
nothing of the job touches memory any more: whoever waits for results (the tiered
store's slot pins, vLLM keeping a loading request's blocks) keeps that memory till then.

Engine memory on the CPU: a worker copies a job on the spot. On a GPU: a worker
only enqueues the job on the direction's copy stream (several jobs may be in
flight) and the job completes when its event does, seen by `event.query()` from
the worker (every `POLL_INTERVAL_S` while jobs are in flight) or from `poll`;
nothing synchronises on the host. A GPU copy waits for an `EngineReady`: the
caller records it with `engine_ready()` on the engine's stream (e.g. vLLM's
current stream right after the forward, for stores) and passes it as `ready=`;
without one, `submit_*` records it on the calling thread's current stream.

Every job ends with one `TransferResult`, collected with `poll` or `wait`. A
bad id, a conflicting pair or an exception during the copy fails that job and
is logged; it is never raised into the caller.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from kv_offload.canonical import CanonicalKVCaches
from kv_offload.errors import TierClosedError, TransferError
from kv_offload.kernels import BlockCopier, HostSlotLayout
from kv_offload.kernels.cpu import CopyOverrun
from kv_offload.kernels.plan import CopyPlan, IdsLike, id_array
from kv_offload.kernels.runtime import CudaRuntime, EngineReady
from kv_offload.store.host.layer_copies import LayerCopier, LayerSteps, layer_cut_refusal
from kv_offload.store.host.pool import allocate_pool, cuda_present, release_pinned
from kv_offload.store.host.prefault import PoolPrefaulter
from kv_offload.store.host.slots import SlotMap
from kv_offload.transfer import BlockTransfer, Direction, TransferJob, TransferResult
from kv_offload.types import Transfers

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.0002  # how often a worker queries its GPU jobs' events while any run
CLOSE_TIMEOUT_S = 60.0  # close() fails copies (GPU or cancelled CPU ones) still running after this


@dataclass
class _Queued:
    job: TransferJob
    ready: EngineReady | None
    layers: LayerSteps | None = None  # a job cut per layer (layer_copies.py)
    cancelled: threading.Event | None = None  # set: the caller gave the job up (CPU)


@dataclass
class _InFlight:
    job: TransferJob
    handle: object  # BlockCopier.submit's handle: done(), wait(), error
    num_bytes: int
    started: float


class HostTier:
    """Host-memory tier for one engine's canonical KV caches."""

    def __init__(self, canonical: CanonicalKVCaches, cpu_bytes_to_use: int, *,
                 pin: bool | None = None, runtime: CudaRuntime | None = None,
                 gate_timeout_s: float = 30.0, copy_timeout_s: float = 30.0,
                 close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """`runtime` drives the GPU copy path with another CUDA runtime than cupy's
        (the tests' host executor); by default the engine memory's device decides.
        `gate_timeout_s`: how long a store cut per layer waits for a layer's release.
        `copy_timeout_s`: how long one CPU copy is waited for (by the engine's thread for
        an inline job, a job thread otherwise) before it is cancelled and fails.
        `close_timeout_s`: how long `close` waits for copies still running."""
        self.layout = HostSlotLayout.from_canonical(canonical)
        self.pool = allocate_pool(self.layout, cpu_bytes_to_use, pin, runtime)
        # Page-locked (the GPU reaches it), or plain memory whose pages are faulted in
        # ahead of the slots in use (prefault.py).
        self.pinned = runtime is not None or (cuda_present() if pin is None else pin)
        self.prefaulter = None if self.pinned else PoolPrefaulter(self.pool,
                                                                  self.layout.slot_bytes)
        if self.prefaulter is not None:
            self.prefaulter.start()
        self.copier = BlockCopier(canonical, self.pool, self.layout, runtime)
        self.gate_timeout_s = gate_timeout_s
        self.copy_timeout_s = copy_timeout_s
        self.close_timeout_s = close_timeout_s
        # Jobs cut per layer: CPU engine memory whose layers each have their own bytes
        # (GPU copies run on streams and are not cut yet: such jobs run whole).
        self.layer_copier = None if self.copier.asynchronous or layer_cut_refusal(canonical) \
            else LayerCopier(canonical, self.pool, self.layout)
        self.slot_map = SlotMap(self.num_slots)
        self._ids = itertools.count(1)
        self._finished: dict[int, TransferResult] = {}
        self._pending: set[int] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._copies_abandoned = False  # a copy still ran when close() gave up on it
        self._cancels: dict[int, threading.Event] = {}  # pending CPU jobs' stop signals
        self._queues = {d: queue.SimpleQueue() for d in Direction}
        self._in_flight: dict[Direction, deque[_InFlight]] = {d: deque() for d in Direction}
        self._workers = [
            threading.Thread(target=self._work, args=(d,), daemon=True,
                             name=f"kv-offload-cpu-{d.value}")
            for d in Direction
        ]
        for worker in self._workers:
            worker.start()

    @property
    def num_slots(self) -> int:
        return int(self.pool.shape[0])

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes

    def slot_buffer(self, slot: int, group: int | None = None) -> torch.Tensor:
        """A 1-D int8 view of one slot (only the bytes `group` uses, if given):
        the buffer a secondary tier writes out or reads back."""
        if not 0 <= slot < self.num_slots:
            raise TransferError(f"slot {slot} is out of range; expected 0 <= slot < "
                                f"{self.num_slots}")
        size = self.slot_bytes if group is None else self.layout.group_bytes[group]
        return self.pool[int(self.slot_map.rows(np.int64(slot))), :size]

    def pool_rows(self, slots: IdsLike) -> np.ndarray:
        """The pool rows that hold these slots now (see slots.py): `pool[pool_rows(s)]`
        are the slots' bytes. For tests and tools; tiers use `slot_buffer`."""
        slots = np.asarray(slots, dtype=np.int64)
        if slots.size and (slots.min() < 0 or slots.max() >= self.num_slots):
            raise TransferError(f"slot ids must be in [0, {self.num_slots})")
        return self.slot_map.rows(slots)

    def slots_in_use_below(self, high_water: int) -> None:
        """The manager handed out slots below `high_water` (O(1)): plain host memory is
        faulted in ahead of them, in the background."""
        if self.prefaulter is not None:
            self.prefaulter.slots_in_use_below(high_water)

    def engine_ready(self) -> EngineReady:
        """Record, on the calling thread's current stream (the engine's), the point a
        copy must wait for; pass it to `submit_store`/`submit_load` as `ready`. On
        CPU engine memory there is nothing to wait for (an empty EngineReady)."""
        return self.copier.engine_ready()

    def submit_store(self, transfers: Transfers, ready: EngineReady | None = None) -> int:
        """Start copying engine blocks into slots: `{group: (block_ids, slot_ids)}`,
        on a GPU after `ready` (the forward that wrote the blocks)."""
        return self.submit(Direction.STORE, transfers, ready)

    def submit_load(self, transfers: Transfers, ready: EngineReady | None = None) -> int:
        """Start copying slots back into engine blocks: `{group: (block_ids, slot_ids)}`,
        on a GPU after `ready` (the engine's own work on those blocks)."""
        return self.submit(Direction.LOAD, transfers, ready)

    def submit(self, direction: Direction, transfers: Transfers,
               ready: EngineReady | None = None, layers: LayerSteps | None = None,
               inline: bool = False) -> int:
        """Queue a job and return its id at once. Raises only after `close`.
        GPU: `ready` None records one now on the calling thread's current stream.
        `layers`: copy the job a layer at a time, through these gates and progress (a
        job whose copies cannot be cut per layer waits for every gate, then runs whole).
        `inline` (CPU engines, no `layers`): copy here, before returning (the result is
        then ready for `poll`); the copy's own threads still move the bytes."""
        cancelled = None if self.copier.asynchronous else threading.Event()
        with self._cond:
            if self._closed:
                raise TierClosedError("HostTier is closed; no new jobs are accepted")
            job_id = next(self._ids)
            self._pending.add(job_id)
            if cancelled is not None:
                self._cancels[job_id] = cancelled
            # (while a cancelled copy still runs, a copy thread is stalled: the engine's
            # thread does not wait for them again, the job thread does; O(such copies))
            inline = inline and cancelled is not None and \
                all(f.handle.done() for f in self._in_flight[direction])
        try:
            job = TransferJob(job_id, direction, _block_transfers(transfers))
            if ready is None and self.copier.asynchronous:
                ready = self.copier.engine_ready()
            elif ready is not None and not isinstance(ready, EngineReady):
                raise TransferError(f"ready must be an EngineReady (from engine_ready()), "
                                    f"got {type(ready).__name__}")
        except Exception as exc:  # unreadable ids: fail the job, do not raise
            self._finish(_failure(job_id, direction, (), 0.0, exc))
            return job_id
        if inline and layers is None and not self.copier.asynchronous:
            # (the CPU copies on the spot: the result is in at return, at most the bound)
            self._start(_Queued(job, ready, cancelled=cancelled))
            self._collect(direction)
        else:
            self._queues[direction].put(_Queued(job, ready, layers, cancelled))
        return job_id

    def cancel(self, job_id: int) -> None:
        """The caller gave this job up (CPU): it does not start if it has not, and a copy
        under way stops before its next op. It still ends with one (failed) result, once
        nothing of it runs. A finished or unknown job, or a GPU one, is left as it is."""
        with self._cond:
            cancelled = self._cancels.get(job_id)
        if cancelled is not None:
            cancelled.set()

    def poll(self) -> list[TransferResult]:
        """Results of the jobs finished since the last call, each once. Never blocks
        (GPU jobs in flight are asked whether their event has completed)."""
        for direction in Direction:
            self._collect(direction)
        with self._cond:
            results = list(self._finished.values())
            self._finished.clear()
        return results

    @property
    def jobs_in_flight(self) -> int:
        """GPU jobs enqueued whose completion has not been seen yet."""
        with self._cond:
            return sum(len(q) for q in self._in_flight.values())

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> list[TransferResult]:
        """Block until every job in `job_ids` has finished; return their results in
        that order (they are not returned by `poll` again). Raises TimeoutError
        if `timeout` seconds pass first, TransferError for an unknown job id."""
        wanted = list(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            for job_id in wanted:
                if job_id not in self._pending and job_id not in self._finished:
                    raise TransferError(f"job {job_id} is unknown or its result was already "
                                        f"collected")
            while any(j in self._pending for j in wanted):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"jobs {sorted(j for j in wanted if j in self._pending)}"
                                       f" did not finish within {timeout} s")
                self._cond.wait(left)
            return [self._finished.pop(j) for j in dict.fromkeys(wanted)]

    def close(self) -> None:
        """Finish queued jobs (their results stay pollable) and stop the workers."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        for q in self._queues.values():
            q.put(None)
        for worker in self._workers:
            worker.join()
        if not self._copies_abandoned:  # else a copy may still be using the pool's pages
            release_pinned(self.pool)
        self.copier.close()
        if self.prefaulter is not None:
            self.prefaulter.close()
        if self.layer_copier is not None:
            self.layer_copier.close()

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _work(self, direction: Direction) -> None:
        jobs = self._queues[direction]
        while True:
            try:  # with GPU jobs in flight, wake up to query their events
                queued = jobs.get(timeout=POLL_INTERVAL_S if self._in_flight[direction]
                                  else None)
            except queue.Empty:
                self._collect(direction)
                continue
            if queued is None:
                break
            self._start(queued)
            self._collect(direction)
        deadline = time.monotonic() + self.close_timeout_s
        while self._in_flight[direction] and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
            self._collect(direction)
        with self._cond:
            stuck, self._in_flight[direction] = list(self._in_flight[direction]), deque()
            self._copies_abandoned = self._copies_abandoned or bool(stuck)
        for flight in stuck:
            self._finish(_failure(flight.job.job_id, direction, flight.job.transfers,
                                  time.perf_counter() - flight.started,
                                  TimeoutError("the copy did not complete before close")))

    def _start(self, queued: _Queued) -> None:
        job, start = queued.job, time.perf_counter()
        try:
            if queued.cancelled is not None and queued.cancelled.is_set():
                raise TimeoutError("the job was cancelled by its caller before it started")
            checked = self.copier.plan(job.direction, {
                t.group: (t.block_ids, t.slot_ids) for t in job.transfers
            })
            plan = self.slot_map.physical(checked, self.copier.canonical.num_blocks)
            handle = self._submit_plan(plan, queued)
        except CopyOverrun as overrun:  # ends, failed, once its last running op has
            logger.warning("kv-offload %s job %d: %s; it fails once its copy threads are "
                           "done", job.direction.value, job.job_id, overrun)
            with self._cond:
                self._in_flight[job.direction].append(_InFlight(job, overrun.run, 0, start))
            overrun.run.when_done(lambda: self._collect(job.direction))
            return
        except Exception as exc:
            self._finish(_failure(job.job_id, job.direction, job.transfers,
                                  time.perf_counter() - start, exc))
            return
        with self._cond:
            self._in_flight[job.direction].append(_InFlight(job, handle, plan.num_bytes, start))

    def _submit_plan(self, plan, queued: _Queued):
        """Hand a checked plan to the copier: whole, or a layer at a time."""
        steps, bound, cancelled = queued.layers, self.copy_timeout_s, queued.cancelled
        if steps is None:
            return self.copier.submit(plan, queued.ready, timeout_s=bound, cancelled=cancelled)
        if self.layer_copier is not None and steps.num_layers == self.layer_copier.num_layers:
            self.layer_copier.copy(plan, steps, self.gate_timeout_s, bound, cancelled)
            return self.copier.submit(_EMPTY_PLANS[plan.direction])  # (done: a handle)
        for layer in range(steps.num_layers):  # not cut: after the last gate, whole
            if not steps.wait_open(layer, self.gate_timeout_s):
                raise TimeoutError(f"layer {layer} was not released within "
                                   f"{self.gate_timeout_s} s")
        return self.copier.submit(plan, queued.ready, timeout_s=bound, cancelled=cancelled)

    def _collect(self, direction: Direction) -> None:
        """Finish the direction's jobs whose copies have completed: on a GPU oldest first
        (one stream: a job completes only after the ones enqueued before it); on the CPU
        any (only a cancelled copy still running is in flight there)."""
        with self._cond:
            flights = self._in_flight[direction]
            for flight in list(flights):
                try:
                    if not flight.handle.done():
                        if self.copier.asynchronous:
                            break
                        continue
                    error = flight.handle.error
                except Exception as exc:  # the runtime failed the query itself
                    error = exc
                flights.remove(flight)
                seconds = time.perf_counter() - flight.started
                job = flight.job
                self._finish_locked(
                    _failure(job.job_id, direction, job.transfers, seconds, error) if error
                    else TransferResult(job.job_id, direction, True, flight.num_bytes, seconds))

    def _finish(self, result: TransferResult) -> None:
        with self._cond:
            self._finish_locked(result)

    def _finish_locked(self, result: TransferResult) -> None:
        self._pending.discard(result.job_id)
        self._cancels.pop(result.job_id, None)
        self._finished[result.job_id] = result
        self._cond.notify_all()


_EMPTY_PLANS = {d: CopyPlan(d, (), 0) for d in Direction}


def _block_transfers(transfers: Transfers) -> tuple[BlockTransfer, ...]:
    if not isinstance(transfers, Mapping):
        raise TransferError(f"transfers must map group -> (block_ids, slot_ids), got "
                            f"{type(transfers).__name__}")
    out = []
    for group, pair in transfers.items():
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TransferError(f"group {group}: expected (block_ids, slot_ids), got {pair!r}")
        out.append(BlockTransfer(group, id_array(pair[0], "block", group, copy=True),
                                 id_array(pair[1], "slot", group, copy=True)))
    return tuple(out)


def _failure(job_id: int, direction: Direction, transfers: tuple[BlockTransfer, ...],
             seconds: float, exc: Exception) -> TransferResult:
    logger.warning("kv-offload %s job %d failed: %s", direction.value, job_id, exc)
    failed = tuple((t.group, tuple(t.block_ids.tolist())) for t in transfers if t.block_ids.size)
    return TransferResult(job_id, direction, False, 0, seconds, failed,
                          f"{type(exc).__name__}: {exc}")
