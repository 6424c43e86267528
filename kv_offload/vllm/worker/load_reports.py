"""What the worker owes vLLM about loads that did not arrive: by request, or by block.

A load vLLM waits for (asynchronous) is reported by request: `finished_loads` names it once,
and as failed if any byte did not arrive (vLLM recomputes the request). An in-step load
(see `vllm/scheduler/in_step_loads.py` for which loads go in-step) is different: vLLM calls
`start_load_kv` before the forward of a step with in-step loads and runs their requests in
that very step, so a failure cannot be reported by request; the blocks that did not arrive
are reported (`take_block_errors`, vLLM's `get_block_ids_with_load_errors`) and vLLM
recomputes them right after that forward.

An in-step load that does not end within `copy_timeout_s` is given up: its blocks are
errors, and its copies may still run. Until they end, vLLM must not hand those blocks to
another request: a finished request of such a load is held (`KVOffloadMetadata.held`) and
reported back in `finished_loads` once no given-up copy of it runs on this rank.

`LoadReports` is that bookkeeping and nothing else: no lock (the worker's is held around
every call), no store, no tensors.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from kv_offload.types import GroupBlocks
from kv_offload.vllm.worker.jobs import Job


class LoadReports:
    """Loads failed before they started, in-step block errors, given-up in-step loads and
    the finished requests held for them."""

    def __init__(self) -> None:
        self._failed_now: set[str] = set()  # loads that could not even start
        self._block_errors: set[int] = set()  # blocks of in-step loads that did not arrive
        # In-step loads given up whose copies may still run: job id -> its request.
        self._given_up: dict[int, str] = {}
        self._held: set[str] = set()  # finished requests vLLM holds until those copies end
        self._released: set[str] = set()  # held requests to report back (finished_loads)

    @property
    def any_failed_now(self) -> bool:
        return bool(self._failed_now)

    @property
    def any_given_up(self) -> bool:
        return bool(self._given_up)

    @property
    def num_given_up(self) -> int:
        return len(self._given_up)

    def given_up_requests(self) -> tuple[str, ...]:
        """Requests with a given-up copy still running (for the rank's report)."""
        return tuple(set(self._given_up.values()))

    def fail(self, request_ids: Collection[str], in_step: Collection[str] = (),
             loads: Mapping[str, GroupBlocks] | None = None,
             failed_blocks: Collection[int] = ()) -> None:
        """These loads failed without starting: by request at the next `take_finished`,
        or, for in-step loads, by their blocks in `loads` (and `failed_blocks`)."""
        self._block_errors.update(failed_blocks)
        for request_id in request_ids:
            if request_id in in_step and loads is not None:
                self._block_errors.update(i for _, ids in loads[request_id].values()
                                          for i in ids)
            else:
                self._failed_now.add(request_id)

    def fail_blocks(self, block_ids: Collection[int]) -> None:
        self._block_errors.update(block_ids)

    def give_up(self, job_id: int, job: Job) -> None:
        """An in-step load past its bound whose copies may still run (reported as stalled
        until its result comes; see `hold`). Its blocks: `fail_blocks`, first."""
        self._given_up[job_id] = job.request_id

    def ended(self, job_id: int) -> None:
        """A job's result came: nothing of it runs now. A held request with no given-up
        copy left is released (vLLM may free its blocks)."""
        request_id = self._given_up.pop(job_id, None)
        if request_id in self._held and request_id not in self._given_up.values():
            self._held.discard(request_id)
            self._released.add(request_id)

    def hold(self, request_ids: Collection[str]) -> None:
        """vLLM keeps the blocks of these finished requests: each is released once no
        given-up copy of it runs, at once where none does. O(requests x loads given up),
        both nearly always 0."""
        running = set(self._given_up.values())
        for request_id in request_ids:
            (self._held if request_id in running else self._released).add(request_id)

    def take_block_errors(self) -> set[int]:
        errors, self._block_errors = self._block_errors, set()
        return errors

    def take_finished(self) -> tuple[set[str], set[str]]:
        """(loads that failed before they started, held requests released) since the last
        call."""
        failed_now, self._failed_now = self._failed_now, set()
        released, self._released = self._released, set()
        return failed_now, released
