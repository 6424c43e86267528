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

This is a mixin of `TieredStore` (it uses the store's manager, host tier, storage tier, view,
fault log and job plumbing); it is its own module only to keep each file one concern.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kv_offload.store.jobs import (
    Store,
    StorePiece,
    TieredResult,
    WriteThrough,
    blocks_of,
    host_copies_of,
    transfers,
)
from kv_offload.store.key_view import storage_key
from kv_offload.types import Direction, OffloadKey


class StorePipeline:
    """The store half of `TieredStore`."""

    def _stage_store(self, store: Store) -> None:
        """Copy the store's waiting keys into host slots, as many as there is room for."""
        while store.waiting and not store.abandoned:
            room = self.manager.num_free_slots + self.manager.num_evictable
            batch = store.waiting[:max(1, room)]
            plan = self.manager.prepare_store(batch)
            while plan is None and len(batch) > 1:  # some room is protected: take less
                batch = batch[:len(batch) // 2]
                plan = self.manager.prepare_store(batch)
            if plan is None:
                break
            del store.waiting[:len(batch)]
            if not plan.keys:  # held already
                continue
            pending = self._protect_on_host
            if pending:  # a lookup protected these before they had a slot
                hit = [k for k in plan.keys if k in pending]
                self.manager.touch(hit)  # (STORING: applied once ready)
                for key in hit:
                    del pending[key]
            firsts = {k: store.targets[k][:1] for k in plan.keys}  # a key listed twice: once
            try:
                self._submit_cpu(StorePiece(store, plan.keys), Direction.STORE,
                                 transfers(plan.keys, plan.slots, firsts), store.ready,
                                 store.layers)
            except Exception:
                self.manager.complete_store(list(plan.keys), False)
                raise
            store.pending += 1
        # Waiting helps only while something in flight will free slots: host copies (this
        # store's pieces, loads into the engine) and storage jobs (write-throughs, reads)
        # release theirs when they end.
        in_flight = bool(store.pending or self._cpu_jobs or self._storage_jobs)
        can_wait = self.storage is not None and in_flight \
            and time.monotonic() - store.started < self.store_stage_timeout_s
        if store.waiting and not store.abandoned and can_wait:
            self._staged_stores[store.job_id] = store
            return
        store.skipped += store.waiting
        store.waiting = []
        self._staged_stores.pop(store.job_id, None)

    def _piece_copied(self, piece: StorePiece, success: bool) -> None:
        store = piece.store
        store.pending -= 1  # first: a fault below must not leave the store pending
        success = success and not store.abandoned
        self.manager.complete_store(list(piece.keys), success)
        if success:
            self._write_through(piece.keys)
        else:
            store.failed += piece.keys
        self._stage_store(store)
        self._finish_store_if_done(store)

    def _advance_staged_stores(self) -> None:
        for store in list(self._staged_stores.values()):
            self._stage_store(store)
            self._finish_store_if_done(store)

    def abandon_store(self, job_id: int) -> None:
        """The engine may overwrite this store's blocks before its copy ends: whatever it
        copies is discarded (failed), no further piece is copied (so no torn block is ever
        served), and its host copies stop before their next op."""
        store = self._stores.get(job_id)
        if store is not None:
            self._abandon(store)
            for cpu_job in host_copies_of(self._cpu_jobs, store):  # (stop before next op)
                self.cpu.cancel(cpu_job)

    def _abandon(self, store: Store) -> None:
        store.abandoned = True
        store.failed += store.waiting
        store.waiting = []
        self._staged_stores.pop(store.job_id, None)
        self._finish_store_if_done(store)

    def _fail_store(self, store: Store) -> None:
        """A fault in this store's bookkeeping: it ends now, failed whole; pieces still in
        flight only release their slots (their copies are discarded)."""
        store.abandoned = True
        store.waiting = []
        self._store_ended(store)
        self._staged_stores.pop(store.job_id, None)
        self._finish(TieredResult(store.job_id, Direction.STORE, False,
                                  blocks_of(store.targets)))

    def _finish_store_if_done(self, store: Store) -> None:
        if store.pending or store.waiting:
            return
        self._store_ended(store)
        missing = dict.fromkeys([*store.failed, *store.skipped])
        failed = blocks_of({k: store.targets[k] for k in missing})
        self._finish(TieredResult(store.job_id, Direction.STORE, not failed, failed,
                                  skipped=len(dict.fromkeys(store.skipped))))

    def _store_ended(self, store: Store) -> None:
        """The store is over (once): loads stop waiting for its keys; those it did not put
        in a host slot are absent now (a load waiting for one fails it: a recompute)."""
        if self._stores.pop(store.job_id, None) is None:
            return
        storing = self._storing
        for key in store.targets:
            left = storing[key] - 1
            if left > 0:
                storing[key] = left
            else:
                del storing[key]
        self._stores_ended += 1

    def _write_through(self, keys: Sequence[OffloadKey]) -> None:
        if self.storage is None:
            return
        todo = [k for k in keys if not self.view.in_storage(k) and self.manager.is_ready(k)]
        if not todo:
            return
        slots = self.manager.prepare_load(todo)  # pinned until their bytes are written
        write = WriteThrough(tuple(todo), self._generation)
        try:
            buffers = [self.cpu.slot_buffer(s, k[1]) for k, s in zip(todo, slots)]
            job = self.storage.submit_write(
                [storage_key(k, self._generation) for k in todo], buffers)
        except Exception as exc:
            self.faults.failed("storage write", exc)
            self.manager.complete_load(todo)
            return
        self._storage_jobs[job] = write

    def _write_done(self, write: WriteThrough, succeeded: Sequence[bool]) -> None:
        self.manager.complete_load(list(write.keys))
        if write.generation == self._generation:
            landed = [k for k, ok in zip(write.keys, succeeded) if ok]
            self.view.storage_added(landed)
            pending = self._protect_on_write
            if pending:  # a lookup protected these while they were on their way: now
                hit = [k for k in landed if k in pending]
                for key in write.keys:
                    pending.pop(key, None)
                if hit:
                    self.storage.touch([storage_key(k, write.generation) for k in hit])
        self._key_failures[Direction.STORE] += list(succeeded).count(False)
        if all(succeeded):
            self.faults.succeeded("storage write")
        else:
            failed = list(succeeded).count(False)
            self.faults.failed("storage write", f"{failed} key(s) not written")
