"""A simulated vLLM engine loop that drives the connector's two halves step by step and
times every call vLLM makes on them.

What is real: vLLM's `Request` (its block hashes, computed by vLLM's own hasher as tokens
arrive), `NewRequestData`, `CachedRequestData` and `SchedulerOutput`; our `OffloadScheduler`
and `OffloadWorker` (with its pump thread, host tier and copy threads) over small CPU KV
caches laid out as vLLM 0.32 allocates them; the metadata crossing between them is pickled
and unpickled each step, as vLLM's multiprocess executor does. What is simulated: the model
forward (a sleep), vLLM's own prefix cache (never hits), and the storage tier
(`SyntheticTier`: a large index, no disk).

One step, in vLLM's order (the calls timed are those vLLM makes on the connector):
  scheduler: lookups of waiting requests (+ `after_alloc`, `source_of` for hits), then
             `build_meta` over the scheduled requests;
  worker:    `wait_for_engine_copies` (handle_preemptions), `start_loads` (start_load_kv),
             forward, `start_stores` (wait_for_save), `finished_loads`
             (get_transfer_results), `report` (build_connector_worker_meta), `take_stats`;
  scheduler: `apply_worker_meta` and `loads_finished` (update_connector_output), then
             `request_finished` for requests that ended.
The workload keeps `num_requests` requests in the system: a third continue documents whose
prefix is on "disk" (loads from the storage tier), a third share system prompts (host hits,
and lookups that wait for a report), a third are fresh; each prefills in chunks under a
token budget, then decodes, then ends and is replaced by a new arrival.
"""

from __future__ import annotations

import gc
import pickle
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from step_cost_compat import report_size, start_loads, step_started
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

SCHEDULER_CALLS = ("lookup", "after_alloc", "source_of", "build_meta", "apply_worker_meta",
                   "loads_finished", "request_finished")
WORKER_CALLS = ("step_started", "wait_for_engine_copies", "start_loads", "start_stores",
                "finished_loads", "report", "take_stats")


@dataclass(frozen=True)
class Workload:
    num_requests: int = 100
    max_batched_tokens: int = 2048
    forward_s: float = 0.02
    block_size: int = 16
    decode_tokens: tuple[int, int] = (32, 512)
    fresh_tokens: tuple[int, int] = (256, 3072)
    suffix_tokens: tuple[int, int] = (32, 512)  # after a document or a system prompt


@dataclass
class StepRecord:
    """What one step cost (wall-clock and engine-thread CPU ns per call name) and what it
    carried."""

    step: int
    ns: dict[str, int]
    cpu_ns: dict[str, int]
    report_keys: int
    scheduled_tokens: int
    stored_blocks: int
    loads: int
    lookups: int
    gc_ns: int = 0  # garbage-collector pauses during the step (any thread: they hold the GIL)
    gc_cpu_ns: int = 0  # the CPU time of those collections
    gc_full: int = 0  # of which full (generation 2) collections

    def side_ns(self, calls: tuple[str, ...], cpu: bool = False) -> int:
        ns = self.cpu_ns if cpu else self.ns
        return sum(ns.get(name, 0) for name in calls)


@dataclass
class _SimRequest:
    request: Request
    output_len: int
    block_ids: list[list[int]]
    new_ids: list[list[int]]
    phase: str = "waiting"  # waiting -> (loading -> loaded ->) running
    sent: bool = False  # vLLM sent its NewRequestData already


@dataclass
class _Step:
    ns: dict[str, int] = field(default_factory=dict)
    cpu_ns: dict[str, int] = field(default_factory=dict)
    lookups: int = 0


class SimEngine:
    """Drives `scheduler` and `worker` through vLLM's per-step calls."""

    def __init__(self, workload: Workload, num_groups: int, num_blocks: int, scheduler,
                 worker, make_request: Callable[[str, list[int]], Request],
                 documents: list[list[int]], system_prompts: list[list[int]],
                 seed: int = 0) -> None:
        self.workload = workload
        self.num_groups = num_groups
        self.scheduler = scheduler
        self.worker = worker
        self.make_request = make_request
        self.documents = documents
        self.system_prompts = system_prompts
        self.rng = random.Random(seed)
        # vLLM's free block queue: allocations take the least recently freed block (the
        # head), frees go to the tail. Block 0 is vLLM's null block.
        self._free = deque(range(1, num_blocks))
        self._requests: dict[str, _SimRequest] = {}
        self._next_id = 0
        self._step = 0
        self.gc = GcWatch()
        for _ in range(workload.num_requests):
            self._arrive()

    def step(self) -> StepRecord:
        timing = _Step()
        output = self._schedule(timing)
        meta = _timed(timing, "build_meta", self.scheduler.build_meta, output)
        self._update_after_schedule(output)
        meta = _ipc(timing, meta)  # the scheduler's process -> every worker's
        worker = self.worker
        _timed(timing, "step_started", step_started, worker)  # (the connector's
        if getattr(meta, "wait_for_stores", True):  # handle_preemptions, at each step's start)
            _timed(timing, "wait_for_engine_copies", worker.wait_for_engine_copies)
        time.sleep(self.workload.forward_s)
        # vLLM 0.32 starts asynchronous loads after the forward, then calls wait_for_save
        # (`_get_kv_connector_output`, `start_after_forward`).
        _timed(timing, "start_loads", lambda: (worker.begin_step(meta.step),
                                               start_loads(worker, meta)))
        _timed(timing, "start_stores", worker.start_stores, meta.stores)
        finished, failed = _timed(timing, "finished_loads", worker.finished_loads)
        worker_meta = _timed(timing, "report", worker.report)
        _timed(timing, "take_stats", worker.take_stats)
        worker_meta = _ipc(timing, worker_meta)  # and back
        _timed(timing, "apply_worker_meta", self.scheduler.apply_worker_meta, worker_meta)
        _timed(timing, "loads_finished", self.scheduler.loads_finished, finished, failed)
        self._update_from_output(output, finished, failed, timing)
        record = StepRecord(self._step, timing.ns, timing.cpu_ns, report_size(worker_meta),
                            output.total_num_scheduled_tokens,
                            sum(len(ids) for _, ids in meta.stores.values()), len(meta.loads),
                            timing.lookups)
        pauses = self.gc.take()
        record.gc_ns = sum(pause.ns for pause in pauses)
        record.gc_cpu_ns = sum(pause.cpu_ns for pause in pauses)
        record.gc_full = sum(1 for pause in pauses if pause.generation == 2)
        self._step += 1
        return record

    # --- vLLM's scheduler, reduced to what the connector sees ---

    def _schedule(self, timing: _Step) -> SchedulerOutput:
        budget = self.workload.max_batched_tokens
        scheduled: dict[str, int] = {}
        new: list[NewRequestData] = []
        cached = CachedRequestData.make_empty()
        running = [(r, s) for r, s in self._requests.items() if s.phase == "running"]
        waiting = [(r, s) for r, s in self._requests.items() if s.phase != "running"]
        for req_id, sim in running + waiting:  # vLLM: running requests first
            if budget <= 0:
                break
            if sim.phase == "waiting" and not self._admit(sim, timing):
                continue
            if sim.phase not in ("running", "loaded"):
                continue
            request = sim.request
            tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if tokens <= 0 or not self._grow(sim, request.num_computed_tokens + tokens):
                continue
            budget -= tokens
            scheduled[req_id] = tokens
            sim.phase = "running"
            if not sim.sent:
                sim.sent = True
                new.append(NewRequestData.from_request(
                    request, tuple(list(ids) for ids in sim.block_ids)))
            else:
                cached.req_ids.append(req_id)
                cached.new_token_ids.append([])
                cached.new_block_ids.append(
                    tuple(sim.new_ids) if any(sim.new_ids) else None)
                cached.num_computed_tokens.append(request.num_computed_tokens)
                cached.num_output_tokens.append(request.num_output_tokens)
            sim.new_ids = [[] for _ in range(self.num_groups)]
        return SchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=set(), free_encoder_mm_hashes=[],
            preempted_req_ids=set())  # (the simulation never preempts)

    def _admit(self, sim: _SimRequest, timing: _Step) -> bool:
        """The connector's lookup for a waiting request; True when it can run now."""
        request = sim.request
        timing.lookups += 1
        tokens, load_async, _ = _timed(timing, "lookup", self.scheduler.num_new_matched_tokens,
                                       request, 0)
        if tokens is None:  # asked again next step
            return False
        if load_async and tokens > 0:
            if not self._grow(sim, tokens):
                return False
            _timed(timing, "after_alloc", self.scheduler.after_alloc, request,
                   tuple(sim.block_ids), tokens)
            _timed(timing, "source_of", self.scheduler.source_of, request.request_id)
            sim.phase = "loading"
            return False
        _timed(timing, "after_alloc", self.scheduler.after_alloc, request,
               tuple(sim.block_ids), 0)
        sim.phase = "running"
        return True

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        for req_id, tokens in output.num_scheduled_tokens.items():
            self._requests[req_id].request.num_computed_tokens += tokens

    def _update_from_output(self, output: SchedulerOutput, finished: set[str],
                            failed: set[str], timing: _Step) -> None:
        for req_id in finished:
            sim = self._requests.get(req_id)
            if sim is not None and sim.phase == "loading":
                sim.phase = "loaded"
                if req_id not in failed:  # a failed load recomputes the whole prompt
                    sim.request.num_computed_tokens = len(sim.block_ids[0]) * \
                        self.workload.block_size
        for req_id in output.num_scheduled_tokens:
            sim = self._requests[req_id]
            request = sim.request
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: nothing sampled yet
            if request.num_output_tokens >= sim.output_len:
                self._finish(req_id, timing)
            else:
                request.append_output_token_ids(self.rng.randrange(1, 30000))

    def _finish(self, req_id: str, timing: _Step) -> None:
        sim = self._requests.pop(req_id)
        keep = _timed(timing, "request_finished", self.scheduler.request_finished, req_id)
        if not keep:
            for ids in sim.block_ids:
                self._free.extend(reversed(ids))  # (vLLM frees a request's tail first)
        self._arrive()

    def _grow(self, sim: _SimRequest, tokens: int) -> bool:
        """Allocate blocks so the request holds `tokens` tokens (every group alike)."""
        needed = -(-tokens // self.workload.block_size) - len(sim.block_ids[0])
        if needed <= 0:
            return True
        if needed * self.num_groups > len(self._free):
            return False
        for ids, new in zip(sim.block_ids, sim.new_ids):
            more = [self._free.popleft() for _ in range(needed)]
            ids.extend(more)
            new.extend(more)
        return True

    def _arrive(self) -> None:
        rng, workload = self.rng, self.workload
        kind = self._next_id % 3
        suffix = [rng.randrange(1, 30000) for _ in range(rng.randint(*workload.suffix_tokens))]
        if kind == 0:
            prompt = rng.choice(self.documents) + suffix
        elif kind == 1:
            prompt = rng.choice(self.system_prompts) + suffix
        else:
            prompt = [rng.randrange(1, 30000) for _ in range(rng.randint(*workload.fresh_tokens))]
        req_id = f"req-{self._next_id}"
        self._next_id += 1
        groups = range(self.num_groups)
        self._requests[req_id] = _SimRequest(self.make_request(req_id, prompt),
                                             rng.randint(*workload.decode_tokens),
                                             [[] for _ in groups], [[] for _ in groups])


@dataclass(frozen=True)
class GcPause:
    generation: int
    ns: int  # wall-clock
    cpu_ns: int  # CPU time of the thread that collected


class GcWatch:
    """Pauses of Python's garbage collector since the last `take`. A collection holds the
    GIL, so it stalls the engine thread whichever thread runs it."""

    def __init__(self) -> None:
        self._pauses: list[GcPause] = []
        self._start = self._start_cpu = 0
        gc.callbacks.append(self._callback)

    def take(self) -> list[GcPause]:
        pauses, self._pauses = self._pauses, []
        return pauses

    def close(self) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start, self._start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        else:
            self._pauses.append(GcPause(info["generation"], time.perf_counter_ns() - self._start,
                                        time.thread_time_ns() - self._start_cpu))


def _timed(timing: _Step, name: str, fn, *args):
    """Call `fn`, adding its wall-clock time (what the engine thread waited: lock waits
    and preemption by other processes included) and the engine thread's CPU time (the
    work itself) to `name`."""
    cpu, start = time.thread_time_ns(), time.perf_counter_ns()
    try:
        return fn(*args)
    finally:
        end, cpu_end = time.perf_counter_ns(), time.thread_time_ns()
        timing.ns[name] = timing.ns.get(name, 0) + end - start
        timing.cpu_ns[name] = timing.cpu_ns.get(name, 0) + cpu_end - cpu


def _ipc(timing: _Step, obj):
    """What crosses a process boundary in vLLM arrives as a pickled copy (timed as "ipc":
    vLLM's cost for our metadata, on neither side's step path in this benchmark)."""
    return _timed(timing, "ipc", lambda: pickle.loads(
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)))
