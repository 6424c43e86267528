"""Which hits load inside the step that schedules their request (no extra step).

An asynchronous load parks its request in vLLM's WAITING_FOR_REMOTE_KVS until the load
reports back: at least one more scheduler step before the prefill, which is most of what a
hit cost beyond vLLM's own prefix hit. An in-step load is planned in the same step instead:
vLLM calls `start_load_kv` before that step's forward, the worker finishes the copies (and
reads) before returning (or, layer-wise, before each layer's forward: worker/layers.py), and
the forward runs the request's prefill on the loaded blocks.

A hit loads in-step only when that is both safe and cheap (else asynchronously, as before):
- its bytes per rank are at most `in_step_load_bytes` (the knob; 0 turns in-step loads off);
- every block it loads is in host memory on every rank, or its store is planned (it lands
  in host memory; the worker's load waits for that store's copy, bounded, and fails the
  block if the store does not land); or, for the blocks that must be read from the storage
  tier (disk, a shared store), the read is expected to take at most `in_step_read_s`: those
  bytes on a rank over that rank's measured read throughput (`kv_offload.store.read_rate`, in
  each rank's report), the slowest rank deciding. A rank that has not yet read anything
  has no figure: asynchronous (a probe read at start-up measures a storage tier that
  already holds keys: kv_offload.store.probe; else its first read measures the tier).
  A read inside the step stalls every request of the batch for its duration, so large
  reads stay asynchronous;
- no rank reports a stalled copy (an in-step load it gave up at `copy_timeout_s` still runs):
  while one does, a new in-step load would wait the same bound, a stall of the whole batch
  at every step; asynchronous loads keep the engine going meanwhile;
- the model has one KV-cache group of attention layers: a failed in-step load is reported
  to vLLM as block ids (`get_block_ids_with_load_errors`, which vLLM 0.32 refuses for
  models with several groups), and Mamba-type groups in prefix-caching align mode need the
  asynchronous path (a synchronous load would lose the state vLLM moves).
A failed in-step load is still a recompute: vLLM drops what the forward computed from the
blocks that did not arrive and recomputes them.

A load given up at `copy_timeout_s` may still have a copy running: one a stalled thread was
already inside when its cancel came (the others never start). It writes the hit's own bytes
into the request's blocks, which is harmless while the request holds them. So a request that
finishes while some rank still reports such a copy for it is held (`must_hold`): vLLM keeps
its blocks until every rank says no copy of it runs there (`finished_recving`), instead of
handing them to another request. So is one that finishes before every rank has reported on
the step of its load, unless it cannot have failed: vLLM ended it for its own output and no
block of that load was reported failed (a failed in-step load rewinds its request, so it
cannot end in that step; the usual short request that ends in its load step is not held).
A preempted request's blocks are freed at once (vLLM asks no connector): those blocks are
fenced instead, and a step that hands one out first waits for the given-up copies
(`KVOffloadMetadata.wait_for_loads`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kv_offload.specs import KVCacheSpec, MambaSpec
from kv_offload.types import HOST_BIT
from kv_offload.vllm.scheduler.rank_keys import RankKeys


class InStepLoads:
    """The per-request choice between an in-step and an asynchronous load."""

    def __init__(self, specs: Sequence[KVCacheSpec], block_bytes: Sequence[int],
                 budget_bytes: int, *, read_budget_s: float = 0.0, world_size: int = 1
                 ) -> None:
        self.block_bytes = list(block_bytes)  # per group: one block's bytes on a rank
        self.budget_bytes = budget_bytes
        self.read_budget_s = read_budget_s
        self.world_size = world_size
        self.enabled = budget_bytes > 0 and len(specs) == 1 and \
            not isinstance(specs[0], MambaSpec) and len(self.block_bytes) == 1
        self._block_size = [spec.block_size for spec in specs]
        self._read_rates: dict[int, float] = {}  # rank -> measured bytes/s (reports)
        # rank -> requests whose in-step loads it gave up and which still run there
        self._stalled: dict[int, tuple[str, ...]] = {}
        self._reported_step: dict[int, int] = {}  # rank -> the last step its report covers
        # Blocks of preempted requests that a given-up in-step load may still write (vLLM
        # freed them): block -> (request, load step); handing one out makes the forward wait.
        self._fence: dict[int, tuple[str, int]] = {}
        self._fence_step = -1  # the latest load step in `_fence`

    def reported_read_rate(self, rank: int, bytes_per_s: float) -> None:
        """A rank's report of its measured storage read throughput (0: none yet)."""
        if bytes_per_s > 0:
            self._read_rates[rank] = bytes_per_s

    def reported_stalled(self, rank: int, stalled: tuple[str, ...], step: int) -> None:
        """A rank's report of the requests whose in-step loads it gave up and which still
        run, as of plan step `step`."""
        if stalled:
            self._stalled[rank] = stalled
        else:
            self._stalled.pop(rank, None)
        self._reported_step[rank] = step

    @property
    def reported_through(self) -> int:
        """The last plan step every rank has reported on (-1 until all have). O(ranks)."""
        if len(self._reported_step) < self.world_size:
            return -1
        return min(self._reported_step.values())

    def must_hold(self, request_id: str, load_step: int, may_have_failed: bool = True
                  ) -> bool:
        """Whether vLLM must keep the blocks of a request that finishes now, whose in-step
        load was planned at `load_step`: a rank still reports a copy of that load running,
        or some rank has not yet reported on that step and the load `may_have_failed`
        there. O(ranks)."""
        if any(request_id in stalled for stalled in self._stalled.values()):
            return True
        return may_have_failed and self.reported_through < load_step

    def preempted(self, request_id: str, load_step: int, block_ids: list[int]) -> None:
        """vLLM preempted a request whose in-step load (planned at `load_step`, filling
        `block_ids`) may still copy on some rank, and freed its blocks: fence them."""
        if self.must_hold(request_id, load_step):
            self._fence.update(dict.fromkeys(block_ids, (request_id, load_step)))
            self._fence_step = max(self._fence_step, load_step)

    def reuses_fenced(self, allocated: list[int]) -> bool:
        """Whether a block vLLM hands out in this step may still be written by a given-up
        in-step load. O(blocks allocated) while any block is fenced, else O(1)."""
        fence = self._fence
        if not fence:
            return False
        if not self._stalled and self.reported_through >= self._fence_step:
            fence.clear()  # every rank reported on those loads, and none still runs
            return False
        return any(self.must_hold(*fence[i]) for i in allocated if i in fence)

    def fits(self, hit: Any, local_tokens: int, keys: RankKeys,
             hash_of: Callable[[int, int], bytes],
             planned: Callable[[int], Mapping[bytes, int]] = lambda group: {}) -> bool:
        """Whether `hit` (a `CacheHit` beyond `local_tokens` of vLLM's own) loads in-step:
        within the byte budget, and every block it loads held in host memory by every rank
        (or its store planned: `planned(group)`, it lands in host memory) or read from the
        storage tier within the read-time budget. O(blocks loaded x ranks), once per lookup
        that hits."""
        if not self.enabled or self._stalled:
            return False
        total = 0
        read_bytes: dict[int, int] = {}  # rank -> bytes it must read from its storage tier
        for g, blocks in enumerate(hit.blocks):
            in_flight = planned(g)
            first = local_tokens // self._block_size[g]  # the engine has the blocks before
            new = [i for i in blocks if i >= first]
            total += len(new) * self.block_bytes[g]
            if total > self.budget_bytes:
                return False
            if in_flight:
                new = [i for i in new if hash_of(g, i) not in in_flight]
            hashes = [hash_of(g, i) for i in new]
            for rank, held in enumerate(keys.group_maps(g)):
                on_storage = sum(not held.get(h, 0) & HOST_BIT for h in hashes)
                if on_storage:
                    read_bytes[rank] = read_bytes.get(rank, 0) + on_storage * self.block_bytes[g]
        return not read_bytes or self._reads_fit(read_bytes)

    def _reads_fit(self, read_bytes: dict[int, int]) -> bool:
        """Whether every rank is expected to read its bytes within `read_budget_s`."""
        if self.read_budget_s <= 0:
            return False
        rates = list(self._read_rates.values())
        if len(rates) < self.world_size:  # some rank has no figure yet
            return False
        slowest = min(rates)  # (ranks are indexed by report order here, not by rank id)
        return max(read_bytes.values()) / slowest <= self.read_budget_s
