"""The worker's half of in-step loads (see in_step_loads.py for which loads go in-step).

`start_loads` submits an in-step load like any other, then `_finish_in_step_loads` drives the
store until it ended: vLLM calls `start_load_kv` before the forward of a step with in-step
loads, so the forward reads complete blocks. Their requests run in this very step, so a
failure cannot be reported by request (`failed_recving`): the blocks that did not arrive
are reported (`take_block_errors`, vLLM's `get_block_ids_with_load_errors`) and vLLM
recomputes them right after that forward.

A mixin of `OffloadWorker` (its lock, jobs, store and fault log); its own module only to keep
each file one concern.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from kv_offload.types import GroupBlocks


class InStepLoadsOfWorker:
    """In-step loads: waited for before the forward, failures reported by block."""

    def _finish_in_step_loads(self, timeout_s: float | None = None) -> None:
        """Lock held: drive the store until this step's in-step loads ended (their copies
        are all in engine memory), at most `timeout_s` (default `copy_timeout_s`); past it,
        their blocks are reported failed and the loads given up (a stuck thread: the fault
        log): no further copy of theirs starts, so vLLM's recompute of those blocks is not
        overwritten later, and their late results are ignored."""
        timeout_s = self.copy_timeout_s if timeout_s is None else max(0.0, timeout_s)
        if self._drive_until(lambda: not any(j.in_step for j in self._jobs.values()),
                             timeout_s):
            return
        late = [job_id for job_id, job in self._jobs.items() if job.in_step]
        self.faults.failed("in-step load", f"{len(late)} load(s) not done within "
                           f"{self.copy_timeout_s} s; recomputed")
        for job_id in late:
            job = self._jobs.pop(job_id)
            self._block_errors.update(job.block_ids)
            self._loads_in_flight -= 1
            self.store.abandon_load(job_id)
            # (reported as stalled copies until its result comes; see hold_for_copies)
            self._given_up[job_id] = job.request_id

    def wait_for_given_up_loads(self) -> None:
        """Before a forward: block until no in-step load given up on this rank still runs
        (`KVOffloadMetadata.wait_for_loads`: vLLM handed a block one of them may write to
        another request). Without a bound, unlike every other wait here: going on could put
        one request's bytes into another's blocks. Each `copy_timeout_s` passed is a fault
        (counted, logged once per episode)."""
        with self._lock:
            while not self._drive_until(lambda: not self._given_up, self.copy_timeout_s):
                self.faults.failed("given-up load", f"the forward waits for "
                                   f"{len(self._given_up)} given-up load(s) still copying "
                                   "into blocks vLLM handed to another request")

    def hold_for_copies(self, request_ids: Collection[str]) -> None:
        """vLLM keeps the blocks of these finished requests (`KVOffloadMetadata.held`):
        report each back in `finished_loads` once no given-up copy of it runs on this rank,
        at once where none does. O(requests x loads given up), both nearly always 0."""
        if not request_ids:
            return
        with self._lock:
            running = set(self._given_up.values())
            for request_id in request_ids:
                (self._held if request_id in running else self._released).add(request_id)

    def fail_loads(self, request_ids: Collection[str], in_step: Collection[str] = (),
                   loads: Mapping[str, GroupBlocks] | None = None,
                   failed_blocks: Collection[int] = ()) -> None:
        """Report these loads failed without starting them (a recovery path: it only
        records): by request at the next `finished_loads`, or, for in-step loads (whose
        requests vLLM runs in this step), by their blocks in `loads` (and `failed_blocks`)."""
        with self._lock:
            self._block_errors.update(failed_blocks)
            for request_id in request_ids:
                if request_id in in_step and loads is not None:
                    self._block_errors.update(i for _, ids in loads[request_id].values()
                                              for i in ids)
                else:
                    self._failed_now.add(request_id)

    def take_block_errors(self) -> set[int]:
        """Engine blocks of in-step loads that did not arrive since the last call (vLLM
        recomputes them, right after the forward that read them)."""
        with self._lock:
            self._end_layer_loads()  # (after the forward: layer-wise loads end here at last)
            errors, self._block_errors = self._block_errors, set()
        return errors
