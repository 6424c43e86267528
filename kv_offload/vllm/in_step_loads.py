"""Which hits load inside the step that schedules their request (no extra step).

An asynchronous load parks its request in vLLM's WAITING_FOR_REMOTE_KVS until the load
reports back: at least one more scheduler step before the prefill, which is most of what a
host-tier hit cost beyond vLLM's own prefix hit. An in-step load is planned in the same
step instead: vLLM calls `start_load_kv` before that step's forward, the worker finishes the
copies before returning, and the forward runs the request's prefill on the loaded blocks.

A hit loads in-step only when that is both safe and cheap (else asynchronously, as before):
- every block it loads is in host memory on every rank, or its store is planned (it lands
  in host memory; the worker's load waits for that store's copy, bounded, and fails the
  block if the store does not land) (a copy, no storage read: a disk or network read
  inside the step would stall every request of the batch);
- its bytes per rank are at most `in_step_load_bytes` (the knob; 0 turns it off);
- the model has one KV-cache group of attention layers: a failed in-step load is reported
  to vLLM as block ids (`get_block_ids_with_load_errors`, which vLLM 0.32 refuses for
  models with several groups), and Mamba-type groups in prefix-caching align mode need the
  asynchronous path (a synchronous load would lose the state vLLM moves).
A failed in-step load is still a recompute: vLLM drops what the forward computed from the
blocks that did not arrive and recomputes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kv_offload.specs import KVCacheSpec, MambaSpec
from kv_offload.types import HOST_BIT
from kv_offload.vllm.rank_keys import RankKeys


class InStepLoads:
    """The per-request choice between an in-step and an asynchronous load."""

    def __init__(self, specs: Sequence[KVCacheSpec], block_bytes: Sequence[int],
                 budget_bytes: int) -> None:
        self.block_bytes = list(block_bytes)  # per group: one block's bytes on a rank
        self.budget_bytes = budget_bytes
        self.enabled = budget_bytes > 0 and len(specs) == 1 and \
            not isinstance(specs[0], MambaSpec) and len(self.block_bytes) == 1
        self._block_size = [spec.block_size for spec in specs]

    def fits(self, hit: Any, local_tokens: int, keys: RankKeys,
             hash_of: Callable[[int, int], bytes],
             planned: Callable[[int], Mapping[bytes, int]] = lambda group: {}) -> bool:
        """Whether `hit` (a `CacheHit` beyond `local_tokens` of vLLM's own) loads in-step:
        within the budget, and every block it loads held in host memory by every rank, or
        its store planned (`planned(group)`: it lands in host memory; the worker's load
        waits for it). O(blocks loaded x ranks), once per lookup that hits."""
        if not self.enabled:
            return False
        total = 0
        for g, blocks in enumerate(hit.blocks):
            first = local_tokens // self._block_size[g]
            in_flight = planned(g)
            new = [i for i in blocks if i >= first]
            total += len(new) * self.block_bytes[g]
            if total > self.budget_bytes:
                return False
            if in_flight:
                new = [i for i in new if hash_of(g, i) not in in_flight]
            for held in keys.group_maps(g):
                if not all(held.get(hash_of(g, i), 0) & HOST_BIT for i in new):
                    return False
        return True
