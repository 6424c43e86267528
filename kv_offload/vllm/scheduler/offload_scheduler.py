"""The connector's scheduler side: hits, load plans and store plans. No tensors here.

Keys are `(block hash, group)`, with vLLM's own block hashes (one per full
`hash_block_size` chunk, chained over the prefix). The workers own the tiers; after each
step every rank reports the keys whose location changed (at most a bounded batch per step,
so an inventory found at start-up streams in), and this side keeps each rank's map of
key -> location: a key is a hit only when every rank holds it (each rank holds its own
shard), or when this side planned its store and no report has yet said how it went
(`ReportLag.planned`: the worker's load of such a key waits for that store). So a request
that arrives right after another stored its prefix hits at once instead of waiting a step
for the report. Every step costs what changed in it: report batches, new blocks (each
group's `StoreFrontier` decides each block once), and lookups of requests that arrive or
stop waiting. A store can fail and a report lag, so a hit may still fail to load: vLLM
recomputes it (and this side offers that request no more hits). A hit loads in the step
that schedules its request when `InStepLoads` allows, else asynchronously. Blocks are
stored in the step whose forward completes them, only those some future hit can load
(`StoreFrontier`).

Bounded-replay groups (DeepSeek-V4.1, vLLM 0.33: a spec's `prefix_replay_tokens` > 0) are
never stored nor loaded, and `restored_groups` (what the connector answers to
`get_loaded_kv_cache_group_ids`) leaves them out. vLLM's scheduler then replays the hit's
last `prefix_replay_tokens` tokens for them, keeping the other groups' loaded KV, and drops
any hit of at most that many tokens (`Scheduler.schedule`: `_load_restores_replay_window`,
`_mark_prefix_replay`); so this side reports no such hit, and a longer one in full: the
engine takes exactly what we report and every block we load is used. (Its other rule,
flooring a hit to the scheduler's block size, never bites: our hits are multiples of every
group's block size, and the engine's own hit it hands us is floored to that size already.)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress
from math import lcm
from typing import Any

from kv_offload.config import OffloadConfig
from kv_offload.hits import CacheHit, StoreFrontier, find_longest_cache_hit
from kv_offload.specs import KVCacheSpec
from kv_offload.types import HOST_BIT, GroupBlocks, Location, OffloadKey
from kv_offload.vllm.metadata import KVOffloadMetadata, KVOffloadWorkerMetadata
from kv_offload.vllm.pd_params import promise_for, promise_of, wants_remote_decode
from kv_offload.vllm.scheduler.block_tables import track_block_ids
from kv_offload.vllm.scheduler.in_step_loads import InStepLoads
from kv_offload.vllm.scheduler.kv_events import KVEvents
from kv_offload.vllm.scheduler.mamba_states import BoundaryStateStores, offers_of
from kv_offload.vllm.scheduler.rank_keys import HeldBlocks, RankKeys
from kv_offload.vllm.scheduler.report_lag import ReportLag
from kv_offload.vllm.scheduler.step_plan import StepPlan
from kv_offload.vllm.scheduler.store_fence import StoreFence
from kv_offload.vllm.scheduler.store_waits import FIND, FIND_KEYS, REMOTE, StoreWaits, Wait

NULL_BLOCK_ID = 0  # vLLM's null block (skipped sliding-window / Mamba blocks)
MAX_REPORT_WAIT_S = 5.0  # a lookup waits at most this long for the workers' reports
ASKED_HASHES = 1 << 17  # block hashes of recent lookups remembered (~10 MiB; 4M tokens at 32)


@dataclass
class _Request:
    request: Any  # vllm Request: its block_hashes grow as tokens arrive
    block_ids: list[list[int]] = field(default_factory=list)
    frontiers: list[StoreFrontier] = field(default_factory=list)  # per group: store decisions
    next_store_tokens: int = 0  # computed tokens before any group can have more to store
    waiting_since: float | None = None
    stores_off: bool = False  # its block table may be wrong (a step was missed): never store
    adapter: bool = False  # it runs a LoRA adapter: never looked up or stored
    wait_judged: bool = False  # whether its lookup waits for others' stores was decided
    loading: bool = False
    in_step_load_step: int | None = None  # the plan step of its in-step load, if any
    in_step_blocks: list[int] = field(default_factory=list)  # the blocks that load fills
    in_step_failed: bool = False  # some rank reported a block of that load failed
    load_failed: bool = False
    finished: bool = False
    counted: bool = False  # its lookup is in the stats (vLLM re-asks a request it skipped)


@dataclass(frozen=True)
class PendingHit:
    """A hit answered to vLLM, waiting for the blocks vLLM allocates for it."""

    hit: Any  # CacheHit
    local_tokens: int  # the engine's own prefix hit, before ours
    load_async: bool  # False: loaded in the step that runs the request (in_step_loads.py)


@dataclass(frozen=True)
class LookupResult:
    """What `get_num_new_matched_tokens` learnt, for stats (once per request): hit tokens
    beyond the engine's own prefix hit."""

    query_tokens: int
    hit_tokens: int


class OffloadScheduler:
    """Scheduler-side state of the connector (one per engine)."""

    def __init__(self, specs: list[KVCacheSpec], hash_block_size: int, world_size: int,
                 events: KVEvents | None = None, *, in_step: InStepLoads | None = None,
                 role: str = "kv_both", waits: StoreWaits | None = None) -> None:
        self.specs = specs
        # vLLM's kv_role: a producer stores for others and loads nothing; a consumer loads
        # what others stored and stores nothing; kv_both does both (docs/disaggregated-prefill.md).
        self.loads_on, self.stores_on = role != "kv_producer", role != "kv_consumer"
        self.waits = waits or StoreWaits(OffloadConfig.remote_wait_s, storage=False)
        self.identity = ""  # the ranks' record identity, once they reported it
        self._found_through: dict[int, int] = {}  # per rank: `RankReport.found_through`
        self.in_step = in_step or InStepLoads(specs, [], 0)  # (default: all asynchronous)
        self.events = events or KVEvents()  # KV events for routers (off: does nothing)
        self.hash_block_size = hash_block_size
        self.world_size = world_size
        self.align = lcm(*(spec.block_size for spec in specs))
        self._min_block_size = min(spec.block_size for spec in specs)
        # Groups the engine replays after a hit: never stored nor loaded, nor hashed (vLLM
        # hashes at the gcd of the other groups' block sizes only).
        self._replayed = frozenset(g for g, spec in enumerate(specs)
                                   if spec.prefix_replay_tokens > 0)
        self.replay_tokens = max(spec.prefix_replay_tokens for spec in specs)
        self.restored_groups = tuple(g for g in range(len(specs)) if g not in self._replayed)
        for g, spec in enumerate(specs):
            if g not in self._replayed and spec.block_size % hash_block_size:
                raise ValueError(f"group {g} block size {spec.block_size} is not a multiple "
                                 f"of the hash block size {hash_block_size}")
        self._keys = RankKeys(world_size)  # where each rank holds each key
        # Mamba-type groups store the states vLLM offers, not blocks by position.
        self._states = BoundaryStateStores(specs, hash_block_size)
        self._created = time.monotonic()
        self._requests: dict[str, _Request] = {}
        self._pending_hits: dict[str, PendingHit] = {}
        self._plan = StepPlan()  # what goes to the workers with the next step
        self._asked: dict[int, None] = {}  # hashes of recent lookups (`_asked_before`)
        # Reports lag the plans by a step: stores planned since count as held (in host
        # memory); while a reset is under way a lookup waits for its report (vLLM asks again).
        self._step = 0
        self._lag = ReportLag(world_size)
        # Blocks stores may still read that vLLM freed: reallocating one makes the next
        # forward wait for the stores in flight.
        self._fence = StoreFence(specs)
        self._allocated: list[int] = []  # blocks given to requests since the last step
        # In-step loads not yet reported on by every rank: request -> plan step (in order).
        self._in_step_pending: dict[str, int] = {}

    # --- hits ---

    @property
    def ready(self) -> bool:
        """Every rank has reported (until then a lookup is asked again), or the workers
        took longer than `MAX_REPORT_WAIT_S`: then lookups go on with what is known."""
        return self._keys.complete or \
            time.monotonic() - self._created > MAX_REPORT_WAIT_S

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                               ) -> tuple[int | None, bool, LookupResult | None]:
        """(tokens to load beyond the engine's own hit, load asynchronously, stats or None
        when this request was counted already)."""
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _Request(request)
            # A LoRA adapter changes the KV, and vLLM keys its blocks by the adapter's name,
            # not its content: an adapter reloaded under the same name would be served the
            # old adapter's KV. Such requests are neither looked up nor stored.
            state.stores_off = state.adapter = \
                getattr(request, "lora_request", None) is not None
            state.stores_off |= not self.stores_on
        if state.adapter or not self.loads_on:
            return 0, False, None
        if not self.ready or self._awaiting_reset(state):
            return None, False, None
        if state.load_failed or state.loading:
            return 0, False, None
        hit = self._longest_hit(request, num_computed_tokens)
        if self._waiting(request, state, hit):
            return None, False, None
        result = None
        if not state.counted:  # (once per request: vLLM asks again while it waits)
            result = LookupResult(request.num_tokens,
                                  max(0, hit.num_tokens - num_computed_tokens))
            self._protect(request, hit)
            asked = self._asked_before(request)
            if asked > hit.num_tokens:  # a prefix in demand, stored or on its way: keep it
                self._protect(request, find_longest_cache_hit(
                    self.specs, lambda group, block: True, asked))
        state.counted = True
        if hit.num_tokens <= num_computed_tokens:
            return 0, False, result
        load_async = not self.in_step.fits(
            hit, num_computed_tokens, self._keys, lambda g, i: self._hash_of(request, g, i),
            self._lag.planned)
        self._pending_hits[request.request_id] = PendingHit(hit, num_computed_tokens,
                                                            load_async)
        return hit.num_tokens - num_computed_tokens, load_async, result

    def _waiting(self, request: Any, state: _Request, hit: CacheHit) -> bool:
        """Whether this lookup waits for blocks another engine stored (a prefill server's
        promise, or an idle engine's first lookup: store_waits.py), asking the ranks to
        find the missing keys meanwhile."""
        rid, waits = request.request_id, self.waits
        if not state.wait_judged:  # (once per request)
            state.wait_judged = True
            wanted = (request.num_tokens - 1) // self.align * self.align
            promise = promise_of(request)
            if promise is not None and promise.identity in ("", self.identity):
                waits.begin(rid, REMOTE, min(promise.tokens, wanted))
            elif promise is None and hit.num_tokens < wanted:
                waits.begin(rid, FIND, wanted)
            elif promise is not None:  # (another model or layout: its records are not ours)
                waits.count("remote_foreign")
        wait = waits.get(rid)
        if wait is None:
            return False
        if waits.over(rid, hit.num_tokens):
            waits.end(rid, missed=hit.num_tokens < wait.tokens)
            return False
        if wait.kind == REMOTE:  # (the prefill server may still be writing: ask again)
            if waits.due_to_find(rid):
                self._ask(wait, self._missing_keys(request, hit, wait.tokens))
            return True
        # An idle engine's first lookup: first the first missing block of each group (a
        # prompt nobody stored, the usual case, is answered by one question per group; the
        # rest of a prefix is useless without it), then, if it was there, all the rest.
        if wait.find_step is None:
            self._ask(wait, self._missing_keys(request, hit, wait.tokens, first_only=True))
            wait.hit_at_find = hit.num_tokens
            return True
        if not self._answered(wait.find_step):
            return True
        if wait.rounds == 1 and hit.num_tokens > wait.hit_at_find:
            self._ask(wait, self._missing_keys(request, hit, wait.tokens))
            return True
        waits.end(rid)
        return False

    def _ask(self, wait: Wait, keys: list[OffloadKey]) -> None:
        """Send `keys` to the ranks with the next step (`find`) for `wait`."""
        wait.find_step, wait.rounds = self._step, wait.rounds + 1
        self._plan.find += keys

    def _answered(self, step: int) -> bool:
        """Whether every rank has reported the answers to the `find` of plan step `step`."""
        return len(self._found_through) == self.world_size and \
            min(self._found_through.values()) >= step

    def _missing_keys(self, request: Any, hit: CacheHit, tokens: int,
                      first_only: bool = False) -> list[OffloadKey]:
        """The keys of the blocks beyond `hit` up to `tokens`, of the groups stored by
        position, first blocks first (at most `FIND_KEYS`; one per group: `first_only`)."""
        keys: list[OffloadKey] = []
        for g, spec in enumerate(self.specs):
            if g in self._states.groups or g in self._replayed:
                continue
            per_block = spec.block_size // self.hash_block_size
            first = hit.num_tokens // spec.block_size
            last = min(tokens // spec.block_size, len(request.block_hashes) // per_block,
                       first + (1 if first_only else FIND_KEYS - len(keys)))
            keys += [(self._hash_of(request, g, i), g) for i in range(first, last)]
        return keys

    def transfer_params(self, request: Any) -> dict[str, Any] | None:
        """A finished prefill request's promise to the decode server (pd_params.py): the
        prompt tokens its stored and planned blocks cover. None unless asked for."""
        if not (self.stores_on and wants_remote_decode(request)):
            return None
        state = self._requests.get(request.request_id)
        if state is None or state.stores_off:
            return None
        hit = find_longest_cache_hit(self.specs, self._is_cached_fn(request),
                                     request.num_prompt_tokens - 1)
        self.waits.count("remote_promised_blocks", sum(map(len, hit.blocks)))
        return promise_for(hit.num_tokens, self.identity)

    def _longest_hit(self, request: Any, num_computed_tokens: int):
        """The longest hit every rank can serve (loads larger than a host tier are staged
        through it, so the host tier's size does not bound a hit), and that vLLM takes: with
        a replayed group, none of at most `replay_tokens` (vLLM would drop it, and the
        engine's own hit with it; see the module docstring)."""
        hit = find_longest_cache_hit(self.specs, self._is_cached_fn(request),
                                     request.num_tokens - 1)  # vLLM computes the last token
        if hit.num_tokens <= self.replay_tokens:
            return CacheHit(0, [[] for _ in self.specs])
        return hit

    def _protect(self, request: Any, hit: Any) -> None:
        """Ask the workers to keep the blocks of a hit (`hit.blocks`, per group), whether we
        load it or vLLM's own cache holds those tokens: what the tiers protect is the hit
        length they can serve. For a hybrid that is every group at once (the full-attention
        prefix, the sliding-window blocks right before the hit point, the Mamba state at
        it), never the sliding-window blocks no hit needs. Ordered by the token each block
        ends at, deepest first, so the first blocks of the prefix are the most recent:
        evictions take a protected prefix from its end. O(hit blocks)."""
        if not hit.num_tokens:
            return
        ends = []
        for g, blocks in enumerate(hit.blocks):
            size = self.specs[g].block_size
            ends += [((i + 1) * size, g, i) for i in blocks]
        ends.sort(reverse=True)
        self._plan.protect += [(self._hash_of(request, g, i), g) for _, g, i in ends]

    def _asked_before(self, request: Any) -> int:
        """Tokens of this request's longest prefix that an earlier request also asked for
        (aligned as hits are, below the last token), and remember its own hashes: a prefix
        two requests share is worth keeping before it is even stored (the first request's
        store lands after the second's lookup when both arrive together). The memory is
        the last `ASKED_HASHES` block hashes asked for. O(request blocks), once per
        request."""
        asked, hashes = self._asked, request.block_hashes
        shared = 0
        while shared < len(hashes) and hash(hashes[shared]) in asked:
            shared += 1
        for block_hash in hashes:
            key = hash(block_hash)
            asked.pop(key, None)
            asked[key] = None  # (the most recent last)
        while len(asked) > ASKED_HASHES:
            del asked[next(iter(asked))]
        tokens = min(shared * self.hash_block_size, request.num_tokens - 1)
        return tokens // self.align * self.align

    def after_alloc(self, request: Any, block_ids: tuple[list[int], ...],
                    num_external_tokens: int) -> None:
        """Plan the load of a hit into the blocks vLLM just allocated for it."""
        for ids in block_ids:  # (vLLM may zero them before the next forward)
            self._allocated.extend(ids)
        pending = self._pending_hits.pop(request.request_id, None)
        if num_external_tokens == 0 or pending is None:
            return
        hit, local_tokens = pending.hit, pending.local_tokens
        plan: GroupBlocks = {}
        for g, spec in enumerate(self.specs):
            first = local_tokens // spec.block_size  # the engine has the blocks before this
            hashes, ids, blocks = [], [], []
            for i in hit.blocks[g]:
                if i >= first and block_ids[g][i] != NULL_BLOCK_ID:
                    hashes.append(self._hash_of(request, g, i))
                    ids.append(block_ids[g][i])
                    blocks.append(i)
            if ids:
                plan[g] = (hashes, ids)
                self.events.record_blocks(request, g, blocks)
        self._plan.loads[request.request_id] = plan
        if pending.load_async:
            self._requests[request.request_id].loading = True
        else:  # loaded before this step's forward, which runs the request
            self._plan.in_step.append(request.request_id)
            state = self._requests[request.request_id]
            state.in_step_load_step = self._step
            state.in_step_blocks = [i for _, ids in plan.values() for i in ids]
            self._in_step_pending[request.request_id] = self._step

    def build_meta(self, scheduler_output: Any) -> KVOffloadMetadata:
        """This step's loads (planned since the last call) and stores."""
        allocated = track_block_ids(scheduler_output, self._requests)
        allocated += self._allocated  # blocks vLLM gave loading requests since the last step
        self._allocated = []
        preempted = getattr(scheduler_output, "preempted_req_ids", None)
        if preempted is None:  # (not told which: any store in flight may read a freed block)
            self._fence.unknown_free()
        for req_id in preempted or ():
            self._fence.freed(req_id, self._lag.reflected)
            state = self._requests.get(req_id)
            if state is not None and state.in_step_load_step is not None:
                self.in_step.preempted(req_id, state.in_step_load_step, state.in_step_blocks)
        # A step without a forward (e.g. the one telling the workers which requests ended)
        # delays nothing by waiting: the stores in flight settle, so its report and stats
        # show them even if the engine then goes idle.
        wait_for_stores = self._fence.must_wait(allocated, self._lag.reflected) or \
            not scheduler_output.total_num_scheduled_tokens
        stores: GroupBlocks = {}
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        done_by_request: dict[str, int] = {}
        requests, with_states = self._requests, bool(self._states.groups)
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = requests.get(req_id)
            if state is None:
                continue
            state.loading = False  # it runs: vLLM saw its load end (even if we missed that)
            done = state.request.num_computed_tokens + num_tokens
            if spec_tokens:
                done -= len(spec_tokens.get(req_id, ()))
            if with_states:
                done_by_request[req_id] = done
            if done >= state.next_store_tokens:  # (most decode steps: nothing to store)
                self._plan_stores(state, done, stores)
        if with_states:
            self._plan_state_stores(scheduler_output, done_by_request, stores)
        plan, self._plan = self._plan, StepPlan()
        if scheduler_output.total_num_scheduled_tokens:
            self.waits.forward_planned()
        meta = KVOffloadMetadata(loads=plan.loads, in_step=plan.in_step,
                                 failed_loads=plan.failed_loads,
                                 failed_blocks=plan.failed_blocks, stores=stores,
                                 reset=plan.reset, step=self._step,
                                 wait_for_stores=wait_for_stores,
                                 idle=not scheduler_output.total_num_scheduled_tokens,
                                 held=plan.held,
                                 wait_for_loads=self.in_step.reuses_fenced(allocated),
                                 protect=plan.protect, find=plan.find)
        stored = [(h, g) for g, (hashes, _) in stores.items() for h in hashes]
        self._lag.planned_stores(self._step, stored)
        self._step += 1
        return meta

    def _plan_state_stores(self, scheduler_output: Any, done_by_request: dict[str, int],
                           stores: GroupBlocks) -> None:
        """The Mamba-type states vLLM offers this step (see mamba_states.py)."""
        def request_of(req_id: str) -> Any:
            state = self._requests.get(req_id)
            return None if state is None or state.stores_off else state.request

        added = self._states.plan(
            offers_of(scheduler_output), request_of, done_by_request.get,
            lambda block_hash, g: self._keys.held_by_all((block_hash, g)), stores)
        for offer in added:  # vLLM frees and reuses state blocks while requests run
            self._fence.stored(self._step, offer.request_id, offer.group, [offer.block_id],
                               self._lag.reflected)
            self.events.record_blocks(self._requests[offer.request_id].request, offer.group,
                                      [offer.tokens // self.specs[offer.group].block_size - 1])

    def _plan_stores(self, state: _Request, computed_tokens: int, stores: GroupBlocks) -> None:
        """Add the blocks of this request that became worth storing (linear over the
        request's life: each group's `StoreFrontier` decides each block once). The caller
        calls it only once `computed_tokens` reached `state.next_store_tokens`."""
        request = state.request
        if state.stores_off:
            return
        if not state.frontiers:
            state.frontiers = [StoreFrontier(spec, alignment_tokens=self.align)
                               for spec in self.specs]
        hashes = request.block_hashes
        num_hashes = len(hashes)
        for g, spec in enumerate(self.specs):
            if g in self._states.groups or g in self._replayed:
                continue  # stored from vLLM's offers (_plan_state_stores), or never
            per_block = spec.block_size // self.hash_block_size
            block_ids = state.block_ids[g] if g < len(state.block_ids) else []
            full = min(computed_tokens // spec.block_size, num_hashes // per_block,
                       len(block_ids))
            # A block is worth storing once a hit point that loads it is reached; that can
            # be a later step than the one that computed it (a window before a hit point
            # further on). vLLM keeps such a block until then: it is inside that window.
            new = state.frontiers[g].advance(full)
            if not new:
                continue
            # Lists, not calls per block (a long prefill plans thousands); one run: slices.
            lo, hi = new[0], new[-1] + 1
            run = hi - lo == len(new)
            step_hashes = hashes[(lo + 1) * per_block - 1:hi * per_block:per_block] if run \
                else [hashes[(i + 1) * per_block - 1] for i in new]  # (vLLM's are bytes)
            step_ids = block_ids[lo:hi] if run else [block_ids[i] for i in new]
            held = self._keys.group_maps(g)  # skip null blocks, keys every rank holds
            only = held[0] if len(held) == 1 else None
            planned = self._lag.planned(g)  # and keys whose store is planned already
            keep = [block_id != NULL_BLOCK_ID and block_hash not in planned and (
                block_hash not in only if only is not None else
                not (held and all(block_hash in rank_held for rank_held in held)))
                for block_hash, block_id in zip(step_hashes, step_ids)]
            if not all(keep):
                step_hashes = list(compress(step_hashes, keep))
                step_ids = list(compress(step_ids, keep))
                new = list(compress(new, keep))
            if step_ids:
                self._fence.stored(self._step, request.request_id, g, step_ids,
                                   self._lag.reflected)
                hashes_out, ids_out = stores.setdefault(g, ([], []))
                hashes_out.extend(step_hashes)
                ids_out.extend(step_ids)
                self.events.record_blocks(request, g, new)
        state.next_store_tokens = min(
            (frontier.next_hit_point * spec.block_size
             for g, (frontier, spec) in enumerate(zip(state.frontiers, self.specs))
             if g not in self._states.groups and g not in self._replayed), default=1 << 62)

    def apply_worker_meta(self, meta: KVOffloadWorkerMetadata | None) -> None:
        """Apply the ranks' reports: O(keys changed)."""
        if meta is None:
            return
        for rank, report in meta.reports.items():
            self._lag.reported(rank, report.reflected_step)
            self._found_through[rank] = max(self._found_through.get(rank, -1),
                                            report.found_through)
            self.identity = report.identity or self.identity
            self.in_step.reported_read_rate(rank, report.read_bytes_per_s)
            self.in_step.reported_stalled(rank, report.stalled, report.step)
        pending, reported = self._in_step_pending, self.in_step.reported_through
        while pending and next(iter(pending.values())) <= reported:  # O(reported on)
            del pending[next(iter(pending))]
        self.events.apply_reports(self._keys, meta.reports)  # (and KV events from them)


    def source_of(self, request_id: str) -> Location:
        """HOST when every block of the request's planned load is in every rank's host
        memory (or its store is planned: it lands there), else STORAGE (some of it is read
        from the storage tier first)."""
        plan = self._plan.loads.get(request_id, {})
        for g, (hashes, _) in plan.items():
            planned = self._lag.planned(g)
            for held in self._keys.group_maps(g):  # (plain loops: this runs per hit block)
                for block_hash in hashes:
                    if not held.get(block_hash, 0) & HOST_BIT and block_hash not in planned:
                        return Location.STORAGE
        return Location.HOST

    def loads_finished(self, finished: set[str], failed: set[str]) -> None:
        for req_id in finished:
            state = self._requests.get(req_id)
            if state is None:
                continue
            state.loading = False
            state.load_failed |= req_id in failed
            if state.finished:
                del self._requests[req_id]

    def request_finished(self, request_id: str, ended_by_output: bool = False) -> bool:
        """Whether vLLM must keep the request's blocks (a load into them is in flight, or
        an in-step load given up may still copy: `InStepLoads.must_hold`; they are freed
        when every rank reports the request in `finished_recving`). `ended_by_output`:
        vLLM ended it for its own output (not an abort)."""
        state = self._requests.get(request_id)
        self._pending_hits.pop(request_id, None)
        self.waits.end(request_id)  # (aborted while it waited)
        self._fence.freed(request_id, self._lag.reflected)
        if state is not None and state.loading:
            state.finished = True
            return True
        if state is not None and state.in_step_load_step is not None and \
                self.in_step.must_hold(request_id, state.in_step_load_step,
                                       not ended_by_output or state.in_step_failed):
            state.loading = state.finished = True  # (until the ranks report it back)
            self._plan.held.append(request_id)  # (the workers learn it with the next step)
            return True
        self._requests.pop(request_id, None)
        return False

    def reset(self) -> None:
        """Drop the host tier on every rank with the next step; lookups wait until done."""
        self._plan.reset = True
        self._lag.reset_step = self._step  # the step whose plans will carry it

    # --- recovery paths: what the connector calls *because* something failed ---
    # Each only records: requests whose loads are reported failed (vLLM recomputes them),
    # blocks of in-step loads that cannot arrive (reported by the workers as load errors),
    # in-step loads some rank reported failed, a fence on the next forward when freed
    # blocks are not known. None of them raises into vLLM.

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
        # (the hits' keys to protect are not lost with this step's plans: they go with the next)
        plan = self._plan
        self._plan = StepPlan(protect=plan.protect, find=plan.find)
        failed = [*(r for r in plan.loads if r not in plan.in_step), *plan.failed_loads]
        for request_id in failed:
            state = self._requests.get(request_id)
            if state is not None:
                state.loading = True  # until the workers report it back
        in_step = {r: plan.loads[r] for r in plan.in_step}
        meta = KVOffloadMetadata(loads=in_step, in_step=list(in_step), failed_loads=failed,
                                 failed_blocks=plan.failed_blocks, reset=plan.reset,
                                 step=self._step, held=plan.held)
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
        plan = self._plan
        plan.loads.pop(request_id, None)
        if request_id in plan.in_step or (pending is not None and not pending.load_async):
            plan.in_step = [r for r in plan.in_step if r != request_id]
            plan.failed_blocks.extend(block_ids)
            return
        plan.failed_loads.append(request_id)
        state = self._requests.get(request_id)
        if state is not None:
            state.loading = True  # until the workers report it back

    @property
    def num_keys(self) -> int:  # (tests and tools; O(ranks))
        return self._keys.num_keys

    def _awaiting_reset(self, state: _Request) -> bool:
        """Whether a reset is planned and not yet reported by every rank (what the ranks
        held before it is moot); the wait is bounded by `MAX_REPORT_WAIT_S`. O(1)."""
        if self._lag.reset_step is None:
            state.waiting_since = None
            return False
        now = time.monotonic()
        if state.waiting_since is None:
            state.waiting_since = now
        return now - state.waiting_since < MAX_REPORT_WAIT_S

    def _hash_of(self, request: Any, group: int, block: int) -> bytes:  # (its last hash)
        return bytes(request.block_hashes[(block + 1) * (
            self.specs[group].block_size // self.hash_block_size) - 1])

    def _is_cached_fn(self, request: Any) -> HeldBlocks:
        """`is_cached(group, block)` for one lookup (each block's key: its last hash): held
        by every rank, or its store planned and not yet reported."""
        hashes = request.block_hashes
        return HeldBlocks(self._keys, [
            () if g in self._replayed else  # (never asked: its rule accepts any hit)
            hashes[spec.block_size // self.hash_block_size - 1::
                   spec.block_size // self.hash_block_size]
            for g, spec in enumerate(self.specs)], self._lag.planned)
