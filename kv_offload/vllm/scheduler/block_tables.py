"""Following vLLM's block tables from its scheduler output (the scheduler side, no tensors).

vLLM sends a new request's whole block table once, then only the blocks each step adds
(a request resumed after preemption: its whole new table again). `track_block_ids` keeps
each request's table current and returns every block vLLM may write in this step before or
during its forward: blocks given to scheduled requests, blocks it zeroes
(`new_block_ids_to_zero`) and the destinations of its copy-on-write copies
(`kv_cache_block_copies`, Mamba partial hits). `StoreFence` checks them against the
blocks a store may still read. O(blocks added in the step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def track_block_ids(scheduler_output: Any, requests: Mapping[str, Any]) -> list[int]:
    """Update `requests[req_id].block_ids` (per group) for the scheduled requests we track;
    returns the block ids vLLM may write in this step."""
    written: list[int] = []
    for new in scheduler_output.scheduled_new_reqs:
        for ids in new.block_ids:
            written.extend(ids)
        state = requests.get(new.req_id)
        if state is not None:
            state.block_ids = [list(ids) for ids in new.block_ids]
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
        if new_ids is None:
            continue
        for ids in new_ids:
            written.extend(ids)
        state = requests.get(req_id)
        if state is None:
            continue
        if req_id in cached.resumed_req_ids:
            state.block_ids = [list(ids) for ids in new_ids]
        else:
            for group_ids, more in zip(state.block_ids, new_ids):
                group_ids.extend(more)
    written.extend(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())
    written.extend(copy.dst_block_id for copy in
                   getattr(scheduler_output, "kv_cache_block_copies", None) or ())
    return written
