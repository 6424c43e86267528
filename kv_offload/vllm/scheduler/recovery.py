"""The scheduler side's recovery paths: what the connector calls *because* something
failed (a mixin of `OffloadScheduler`, its own module only to keep each file one concern).

Each only records: requests whose loads are reported failed (vLLM recomputes them), blocks
of in-step loads that cannot arrive (reported by the workers as load errors), in-step loads
some rank reported failed, a fence on the next forward when freed blocks are not known.
None of them raises into vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kv_offload.vllm.metadata import KVOffloadMetadata


class SchedulerRecovery:
    """Recovery paths of `OffloadScheduler` (uses its requests, plans, fence and step)."""

    def fence_next_step(self) -> None:
        """Blocks were freed and we cannot tell which (a recovery path): the next forward
        waits for every store still copying out of engine memory."""
        self._fence.unknown_free()

    def fallback_meta(self, scheduler_output: Any = None) -> KVOffloadMetadata:
        """This step's metadata when `build_meta` failed: no stores, and every load
        planned since the last step reported failed (the requests recompute). The requests
        of this step never store again: their block tables may have missed this step's
        new blocks, and a block stored under the wrong index would serve wrong bytes."""
        for req_id in getattr(scheduler_output, "num_scheduled_tokens", None) or {}:
            state = self._requests.get(req_id)
            if state is not None:
                state.stores_off = True
                state.loading = False  # it runs: vLLM saw its load end
        # (in-step loads still run: their requests run now; a failure is reported by block)
        failed = [*(r for r in self._loads if r not in self._in_step), *self._failed_loads]
        for request_id in failed:
            state = self._requests.get(request_id)
            if state is not None:
                state.loading = True  # until the workers report it back
        in_step = {r: self._loads[r] for r in self._in_step}
        meta = KVOffloadMetadata(loads=in_step, in_step=list(in_step), failed_loads=failed,
                                 failed_blocks=self._failed_blocks, reset=self._reset,
                                 step=self._step, held=self._held)
        self._loads, self._in_step, self._failed_loads, self._reset = {}, [], [], False
        self._failed_blocks, self._held = [], []
        self._step += 1
        return meta

    def blocks_failed(self, block_ids: set[int]) -> None:
        """vLLM was told these blocks failed to load (on some rank): mark the in-step loads
        among them (`InStepLoads.must_hold`). O(in-step loads not yet reported on)."""
        for request_id in self._in_step_pending:
            state = self._requests.get(request_id)
            if state is not None and not block_ids.isdisjoint(state.in_step_blocks):
                state.in_step_failed = True

    def is_loading(self, request_id: str) -> bool:  # (a load into its blocks may run)
        state = self._requests.get(request_id)
        return state is not None and state.loading

    def fail_load(self, request_id: str, block_ids: Sequence[int] = ()) -> None:
        """A hit was promised but its load cannot be planned: the workers report the
        request failed (vLLM recomputes it) and no hit is offered to it again. An in-step
        hit (its request runs in this step) is reported by its blocks, `block_ids` (all of
        the request's: vLLM then recomputes it from its first block)."""
        pending = self._pending_hits.pop(request_id, None)
        self._loads.pop(request_id, None)
        if request_id in self._in_step or (pending is not None and not pending.load_async):
            self._in_step = [r for r in self._in_step if r != request_id]
            self._failed_blocks.extend(block_ids)
            return
        self._failed_loads.append(request_id)
        state = self._requests.get(request_id)
        if state is not None:
            state.loading = True  # until the workers report it back
