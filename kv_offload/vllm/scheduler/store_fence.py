"""When a step's forward must wait for stores still copying out of engine memory.

A store copies engine blocks after the forward that completed them, on the workers' copy
threads (GPU: a copy stream), while the engine goes on. That is safe as long as no later
forward writes a block a store is still reading. vLLM writes a block only after allocating
it, and allocates only free blocks, so the hazard is a block that is
1. being stored (planned at a step whose stores the workers have not reported copied out),
2. freed since (its request finished or was preempted; a sliding window or Mamba state
   moved on: those groups free blocks of running requests), and
3. allocated again in this step (to a scheduled request, or to a request loading a hit).

`StoreFence` tracks exactly those blocks and answers, once per step, whether any block
allocated in it is one (then the workers wait for every store in flight before the
forward, `KVOffloadMetadata.wait_for_stores`). Full-attention blocks of running requests are
never written again, so most steps need no wait: vLLM hands out its least recently freed
blocks first, and a just-freed block comes back soon only when the cache is nearly full.

Costs: `stored` O(blocks stored), `freed` O(that request's blocks stored since its stores
were last reported copied out),
`must_wait` O(blocks allocated in the step). Nothing scans all blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from kv_offload.specs import FullAttentionSpec, KVCacheSpec


class StoreFence:
    """Engine blocks that stores in flight may read and vLLM may reuse."""

    def __init__(self, specs: Sequence[KVCacheSpec]) -> None:
        # Per group: whether vLLM frees blocks of running requests (sliding window, chunked
        # local, Mamba) rather than keeping all of them (full attention).
        self.frees_while_running = [not isinstance(spec, FullAttentionSpec) for spec in specs]
        self._in_flight: dict[str, deque[tuple[int, list[int]]]] = {}  # request -> stores
        # Block id -> the last step storing it, for blocks vLLM may free: a hazard while that
        # step is not yet reflected. Never pruned: it holds at most one entry per engine
        # block (ids are reused), and a stale entry is just an old step.
        self._fenced: dict[int, int] = {}
        self._last_store_step = -1
        self._wait_once = False

    def stored(self, step: int, request_id: str, group: int, block_ids: list[int],
               reflected: int) -> None:
        """`block_ids` of `group` are stored by the plans of `step`; `reflected`: the last
        step whose stores every worker reported copied out."""
        self._last_store_step = step
        if self.frees_while_running[group]:
            self._fence(step, block_ids)  # vLLM may free them while the request runs
            return
        stores = self._in_flight.setdefault(request_id, deque())
        while stores and stores[0][0] <= reflected:  # copied out: no longer a hazard
            stores.popleft()
        stores.append((step, block_ids))  # (the caller's list: never changed after)

    def freed(self, request_id: str, reflected: int) -> None:
        """vLLM frees this request's blocks (finished or preempted); `reflected`: the last
        step whose stores every worker reported copied out."""
        for step, block_ids in self._in_flight.pop(request_id, ()):
            if step > reflected:
                self._fence(step, block_ids)

    def unknown_free(self) -> None:
        """Blocks were freed and we cannot tell which (a recovery path, or vLLM did not
        say which requests it preempted): the next step waits if any store is in flight."""
        self._wait_once = True

    def must_wait(self, allocated: Iterable[int], reflected: int) -> bool:
        """Whether this step's forward must wait for the stores in flight: a block
        `allocated` in this step may still be read by one."""
        if self._wait_once:
            self._wait_once = False
            if self._last_store_step > reflected:
                return True
        if self._last_store_step <= reflected:
            return False  # every store so far is copied out
        step_of = self._fenced.get  # (O(blocks allocated in this step))
        return any(step_of(block_id, -1) > reflected for block_id in allocated)

    def _fence(self, step: int, block_ids: list[int]) -> None:
        self._fenced.update(dict.fromkeys(block_ids, step))
