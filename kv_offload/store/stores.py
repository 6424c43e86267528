"""How `TieredStore` serves a store: engine blocks staged through host slots, then written
through to the storage tier.

A store's keys wait in `Store.waiting` and are copied into host slots a piece at a time,
each piece as large as the host room allows (free slots plus unpinned ready keys, which
the policy may evict: with write-through, every ready key is also in the storage tier).
A copied piece is written through at once; its slots stay pinned until the storage tier
has the bytes, then become evictable, which makes room for the next piece. So a store
larger than the host tier (one step of a large batch, with a small host tier) reaches the
storage tier whole instead of being cut to what fits at one moment.

The store's result is delivered when every piece is copied out of engine memory (the
engine waits for that before its next forward, see the worker's `wait_for_engine_copies`):
staging may make that wait as long as the storage tier takes to write the earlier pieces.
Keys are `skipped` (listed in `failed`, counted in `skipped`) only where waiting cannot
help: no storage tier (every key would evict the store's own earlier pieces), nothing in
flight that will free a slot, or `store_stage_timeout_s` passed. An abandoned store (the engine
stopped waiting) copies no further piece and discards the ones in flight.

The pipeline owns the stores in flight and what waits on them: which keys stores not yet
ended carry (a load of such a key awaits it instead of failing: the scheduler counts planned
stores as hits) and the keys a lookup protected before they reached a tier (touched in the
host tier once their store gets a slot, in the storage tier once their write-through lands).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from kv_offload.kernels.runtime import EngineReady
from kv_offload.store.host.layer_copies import LayerSteps
from kv_offload.store.jobs import (
    Store,
    StorePiece,
    TieredResult,
    WriteThrough,
    blocks_of,
    targets_of,
    transfers,
)
from kv_offload.store.shared import JobBook, Tiers
from kv_offload.types import Direction, GroupBlocks, OffloadKey


class StorePipeline:
    """The stores of a `TieredStore`: engine blocks into host slots, then written through."""

    def __init__(self, tiers: Tiers, book: JobBook, *, stage_timeout_s: float) -> None:
        self._tiers = tiers
        self._book = book
        self.stage_timeout_s = stage_timeout_s
        self._stores: dict[int, Store] = {}  # stores whose result is not delivered yet
        self._staged: dict[int, Store] = {}  # stores waiting for host room
        # Keys of stores not yet ended (how many stores carry each): a load of such a key
        # waits for it instead of failing (the scheduler counts planned stores as hits).
        self.storing: Counter[OffloadKey] = Counter()
        self.ended = 0  # stores ended so far (moves when keys leave `storing`)
        # Keys a lookup's hit protected before they reached a tier (oldest first): touched
        # in the host tier once their store gets its slot (`_stage`), in the storage tier
        # once their write-through lands (`write_done`).
        self.protect_on_host: dict[OffloadKey, None] = {}
        self.protect_on_write: dict[OffloadKey, None] = {}

    def submit(self, requests: GroupBlocks, ready: EngineReady | None,
               layers: LayerSteps | None) -> int:
        """Plan a store (O(blocks) of bookkeeping: on the engine's step path); its pieces
        are copied from the next `advance` on (the pump's thread)."""
        store = Store(self._book.new_job(), {}, time.monotonic(), ready=ready, layers=layers)
        self._stores[store.job_id] = store
        try:
            store.targets = targets_of(requests)
            store.waiting = list(store.targets)
            self.storing.update(store.targets.keys())  # (until `_ended`)
            if store.waiting:
                self._staged[store.job_id] = store
        except Exception as exc:  # e.g. a plug-in eviction policy: skip the rest
            self._tiers.faults.failed("store planning", exc)
            store.failed += store.waiting
            store.waiting = []
            self._staged.pop(store.job_id, None)
        self._finish_if_done(store)
        return store.job_id

    @property
    def busy(self) -> bool:
        return bool(self._staged)

    def protect_later(self, on_host: Sequence[OffloadKey], on_write: Sequence[OffloadKey],
                      limit: int) -> None:
        """Remember keys a lookup protected before they reached the host tier (`on_host`)
        or the storage tier (`on_write`); each set keeps its newest `limit` keys."""
        _remember(self.protect_on_host, on_host, limit)
        _remember(self.protect_on_write, on_write, limit)

    def forget_protected(self) -> None:
        self.protect_on_host.clear()
        self.protect_on_write.clear()

    def advance(self) -> None:
        """At a poll: stage what host room now allows for every store that waits for it."""
        for store in list(self._staged.values()):
            self._stage(store)
            self._finish_if_done(store)

    def _stage(self, store: Store) -> None:
        """Copy the store's waiting keys into host slots, as many as there is room for."""
        manager = self._tiers.manager
        while store.waiting and not store.abandoned:
            room = manager.num_free_slots + manager.num_evictable
            batch = store.waiting[:max(1, room)]
            plan = manager.prepare_store(batch)
            while plan is None and len(batch) > 1:  # some room is protected: take less
                batch = batch[:len(batch) // 2]
                plan = manager.prepare_store(batch)
            if plan is None:
                break
            del store.waiting[:len(batch)]
            if not plan.keys:  # held already
                continue
            pending = self.protect_on_host
            if pending:  # a lookup protected these before they had a slot
                hit = [k for k in plan.keys if k in pending]
                manager.touch(hit)  # (STORING: applied once ready)
                for key in hit:
                    del pending[key]
            firsts = {k: store.targets[k][:1] for k in plan.keys}  # a key listed twice: once
            try:
                self._book.submit_copy(StorePiece(store, plan.keys), Direction.STORE,
                                       transfers(plan.keys, plan.slots, firsts), store.ready,
                                       store.layers)
            except Exception:
                manager.complete_store(list(plan.keys), False)
                raise
            store.pending += 1
        # Waiting helps only while something in flight will free slots: host copies (this
        # store's pieces, loads into the engine) and storage jobs (write-throughs, reads)
        # release theirs when they end.
        in_flight = bool(store.pending or self._book.in_flight)
        can_wait = self._tiers.storage is not None and in_flight \
            and time.monotonic() - store.started < self.stage_timeout_s
        if store.waiting and not store.abandoned and can_wait:
            self._staged[store.job_id] = store
            return
        store.skipped += store.waiting
        store.waiting = []
        self._staged.pop(store.job_id, None)

    def piece_copied(self, piece: StorePiece, success: bool) -> None:
        store = piece.store
        store.pending -= 1  # first: a fault below must not leave the store pending
        success = success and not store.abandoned
        self._tiers.manager.complete_store(list(piece.keys), success)
        if success:
            self._write_through(piece.keys)
        else:
            store.failed += piece.keys
        self._stage(store)
        self._finish_if_done(store)

    def abandon(self, job_id: int) -> None:
        """The engine may overwrite this store's blocks before its copy ends: whatever it
        copies is discarded (failed), no further piece is copied (so no torn block is ever
        served), and its host copies stop before their next op."""
        store = self._stores.get(job_id)
        if store is None:
            return
        store.abandoned = True
        store.failed += store.waiting
        store.waiting = []
        self._staged.pop(store.job_id, None)
        self._finish_if_done(store)
        for cpu_job in self._book.copies_of(store):  # (stop before their next op)
            self._tiers.cpu.cancel(cpu_job)

    def fail(self, store: Store) -> None:
        """A fault in this store's bookkeeping: it ends now, failed whole; pieces still in
        flight only release their slots (their copies are discarded)."""
        store.abandoned = True
        store.waiting = []
        self._ended(store)
        self._staged.pop(store.job_id, None)
        self._book.finish(TieredResult(store.job_id, Direction.STORE, False,
                                       blocks_of(store.targets)))

    def _finish_if_done(self, store: Store) -> None:
        if store.pending or store.waiting:
            return
        self._ended(store)
        missing = dict.fromkeys([*store.failed, *store.skipped])
        failed = blocks_of({k: store.targets[k] for k in missing})
        self._book.finish(TieredResult(store.job_id, Direction.STORE, not failed, failed,
                                       skipped=len(dict.fromkeys(store.skipped))))

    def _ended(self, store: Store) -> None:
        """The store is over (once): loads stop waiting for its keys; those it did not put
        in a host slot are absent now (a load waiting for one fails it: a recompute)."""
        if self._stores.pop(store.job_id, None) is None:
            return
        storing = self.storing
        for key in store.targets:
            left = storing[key] - 1
            if left > 0:
                storing[key] = left
            else:
                del storing[key]
        self.ended += 1

    def _write_through(self, keys: Sequence[OffloadKey]) -> None:
        tiers = self._tiers
        if tiers.storage is None:
            return
        manager, generation = tiers.manager, tiers.generation
        todo = [k for k in keys if not tiers.view.in_storage(k) and manager.is_ready(k)]
        if not todo:
            return
        slots = manager.prepare_load(todo)  # pinned until their bytes are written
        write = WriteThrough(tuple(todo), generation)
        try:
            job = tiers.write_from_slots(todo, slots)
        except Exception as exc:
            tiers.faults.failed("storage write", exc)
            manager.complete_load(todo)
            return
        self._book.storage_jobs[job] = write

    def write_done(self, write: WriteThrough, succeeded: Sequence[bool]) -> None:
        tiers = self._tiers
        tiers.manager.complete_load(list(write.keys))
        tiers.key_failures[Direction.STORE] += list(succeeded).count(False)
        if all(succeeded):
            tiers.faults.succeeded("storage write")
        else:
            failed = list(succeeded).count(False)
            tiers.faults.failed("storage write", f"{failed} key(s) not written")
        if write.generation != tiers.generation:
            return
        landed = [k for k, ok in zip(write.keys, succeeded) if ok]
        tiers.view.storage_added(landed)
        pending = self.protect_on_write
        if pending:  # a lookup protected these while they were on their way: now
            hit = [k for k in landed if k in pending]
            for key in write.keys:
                pending.pop(key, None)
            if hit:  # (after the write's own accounting: a raising touch costs only this)
                tiers.storage.touch(tiers.storage_keys(hit))  # (write.generation: in force)


def _remember(pending: dict[OffloadKey, None], keys: Sequence[OffloadKey], limit: int) -> None:
    """Add keys to an insertion-ordered set, dropping its oldest past `limit`."""
    for key in keys:
        pending.pop(key, None)
        pending[key] = None
    while len(pending) > limit:
        del pending[next(iter(pending))]
