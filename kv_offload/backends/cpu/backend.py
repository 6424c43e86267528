"""CpuBackend: the primary tier, engine blocks <-> host-memory slots, asynchronously.

One slot holds one block of one cache group (layout: kv_offload/kernels/geometry.py). The
scheduler-side manager hands out slot ids in `[0, num_slots)`; this class only
moves bytes. Jobs run on two worker threads, one for stores and one for loads,
so a load never queues behind a long store; jobs of one direction run in
submission order. Nothing orders a store against a load: the caller must not
load a slot before the store into it has finished (the manager's rule anyway).

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
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from kv_offload.backends.cpu.pool import allocate_pool
from kv_offload.backends.cpu.slots import SlotMap
from kv_offload.canonical import CanonicalKVCaches
from kv_offload.errors import TierClosedError, TransferError
from kv_offload.kernels import BlockCopier, HostSlotLayout
from kv_offload.kernels.plan import IdsLike
from kv_offload.transfer import BlockTransfer, Direction, TransferJob, TransferResult

logger = logging.getLogger(__name__)

Transfers = Mapping[int, tuple[IdsLike, IdsLike]]


class CpuBackend:
    """Host-memory tier for one engine's canonical KV caches."""

    def __init__(self, canonical: CanonicalKVCaches, cpu_bytes_to_use: int, *,
                 pin: bool | None = None) -> None:
        self.layout = HostSlotLayout.from_canonical(canonical)
        self.pool = allocate_pool(self.layout, cpu_bytes_to_use, pin)
        self.copier = BlockCopier(canonical, self.pool, self.layout)
        self.slot_map = SlotMap(self.num_slots)
        self._ids = itertools.count(1)
        self._finished: dict[int, TransferResult] = {}
        self._pending: set[int] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._queues = {d: queue.SimpleQueue() for d in Direction}
        self._workers = [
            threading.Thread(target=self._work, args=(self._queues[d],), daemon=True,
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

    def submit_store(self, transfers: Transfers) -> int:
        """Start copying engine blocks into slots: `{group: (block_ids, slot_ids)}`."""
        return self.submit(Direction.STORE, transfers)

    def submit_load(self, transfers: Transfers) -> int:
        """Start copying slots back into engine blocks: `{group: (block_ids, slot_ids)}`."""
        return self.submit(Direction.LOAD, transfers)

    def submit(self, direction: Direction, transfers: Transfers) -> int:
        """Queue a job and return its id at once. Raises only after `close`."""
        with self._cond:
            if self._closed:
                raise TierClosedError("CpuBackend is closed; no new jobs are accepted")
            job_id = next(self._ids)
            self._pending.add(job_id)
        try:
            job = TransferJob(job_id, direction, _block_transfers(transfers))
        except Exception as exc:  # unreadable ids: fail the job, do not raise
            self._finish(_failure(job_id, direction, (), 0.0, exc))
            return job_id
        self._queues[direction].put(job)
        return job_id

    def poll(self) -> list[TransferResult]:
        """Results of the jobs finished since the last call, each once. Never blocks."""
        with self._cond:
            results = list(self._finished.values())
            self._finished.clear()
        return results

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
        self.copier.close()

    def __enter__(self) -> CpuBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _work(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            self._finish(self._run(job))

    def _run(self, job: TransferJob) -> TransferResult:
        start = time.perf_counter()
        try:
            checked = self.copier.plan(job.direction, {
                t.group: (t.block_ids, t.slot_ids) for t in job.transfers
            })
            plan = self.slot_map.physical(checked, self.copier.canonical.num_blocks)
            self.copier.submit(plan).wait()
        except Exception as exc:
            return _failure(job.job_id, job.direction, job.transfers,
                            time.perf_counter() - start, exc)
        return TransferResult(job.job_id, job.direction, True, plan.num_bytes,
                              time.perf_counter() - start)

    def _finish(self, result: TransferResult) -> None:
        with self._cond:
            self._pending.discard(result.job_id)
            self._finished[result.job_id] = result
            self._cond.notify_all()


def _block_transfers(transfers: Transfers) -> tuple[BlockTransfer, ...]:
    if not isinstance(transfers, Mapping):
        raise TransferError(f"transfers must map group -> (block_ids, slot_ids), got "
                            f"{type(transfers).__name__}")
    out = []
    for group, pair in transfers.items():
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TransferError(f"group {group}: expected (block_ids, slot_ids), got {pair!r}")
        out.append(BlockTransfer(group, _id_array(pair[0], group), _id_array(pair[1], group)))
    return tuple(out)


def _id_array(ids: IdsLike, group: int) -> np.ndarray:
    array = np.array(ids.cpu() if isinstance(ids, torch.Tensor) else ids)  # a private copy
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise TransferError(f"group {group}: ids must be a 1-D sequence of ints, got dtype "
                            f"{array.dtype} shape {array.shape}")
    return array.astype(np.int64, copy=False)


def _failure(job_id: int, direction: Direction, transfers: tuple[BlockTransfer, ...],
             seconds: float, exc: Exception) -> TransferResult:
    logger.warning("kv-offload %s job %d failed: %s", direction.value, job_id, exc)
    failed = tuple((t.group, tuple(t.block_ids.tolist())) for t in transfers if t.block_ids.size)
    return TransferResult(job_id, direction, False, 0, seconds, failed,
                          f"{type(exc).__name__}: {exc}")
