"""How `TieredStore` serves a load: host keys copied at once, storage keys staged.

A load's keys already in host slots are pinned and copied into the engine at once. Its
storage-only keys wait in `Load.waiting` and are read into host slots in batches of at most
`staging_slots` keys (as host room allows: a batch that finds no room is retried at every
poll until `read_timeout_s`), each batch copied into the engine and unpinned as it lands,
so a load of any size passes through a small host tier. A read that passes its deadline is
given up (its slots stay reserved until the tier answers; the load goes on without it).

Loads of the same keys at the same time (requests sharing a document, scheduled in one
step) share one read: a key whose host slot another job is filling is `awaiting`, and is
copied into the engine once it is ready there (or failed if that read fails, or at the
deadline). Without this the second load found the slot reserved and failed. A key that a
store still in flight is putting in host memory (the scheduler counts the stores it planned
as hits before the workers report them) is awaited the same way: copied once the store's
copy lands, failed if the store ends without it (skipped, failed, abandoned: a recompute,
never stale bytes).

What waits costs the pump's poll nothing until it can have changed (the poll holds the
interpreter lock the engine's thread needs): a load's awaited keys are looked at again only
once a store or read settled in host memory (`OffloadManager.settled`) or a store ended
(`_stores_ended`), or at its deadline; reads are checked against their deadline oldest
first (`_reads`), not by a scan of every storage job in flight (write-throughs included).

A load's result is delivered only when nothing of it is in flight, even when it failed
whole (`closed`): vLLM frees a failed request's blocks, so no copy of ours may still be
writing them. Handlers decrement `pending` first, so a fault in the rest of a handler
cannot leave the load waiting forever.

This is a mixin of `TieredStore` (it uses the store's manager, host tier, storage tier, view,
fault log and job plumbing); it is its own module only to keep each file one concern.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kv_offload.store.jobs import Load, Read, TieredResult, blocks_of, host_copies_of, transfers
from kv_offload.store.key_view import storage_key
from kv_offload.store.manager import SlotState
from kv_offload.types import Direction, Location, OffloadKey


class LoadPipeline:
    """The load half of `TieredStore`."""

    def _plan_new_loads(self) -> None:
        """Start the loads submitted since the last poll: host keys are pinned and copied
        into the engine at once, storage keys are read into host slots (staged)."""
        loads, self._new_loads = self._new_loads, []
        for load in loads:
            if load.closed:  # (given up before it was planned)
                self._finish_load_if_done(load)
                continue
            try:
                keys = list(load.targets)
                where = self.lookup(keys)
                on_host = [k for k, w in zip(keys, where) if w is Location.HOST]
                load.waiting = [k for k, w in zip(keys, where) if w is Location.STORAGE]
                absent = [k for k, w in zip(keys, where) if w is Location.ABSENT]
                # A key a store in flight is putting in a host slot: copied once it lands.
                storing = self._storing
                load.awaiting = [k for k in absent if k in storing]
                load.failed = [k for k in absent if k not in storing]
                self._copy_to_engine(load, on_host)
                self.manager.touch(on_host)
                self._stage(load)
            except Exception as exc:  # this load fails; the others go on
                self.faults.failed("load planning", exc)
                self._fail_load(load)
            self._finish_load_if_done(load)

    def abandon_load(self, job_id: int) -> None:
        """The caller stopped waiting for this load (an in-step load past its bound, whose
        blocks vLLM recomputes): it fails whole, no further piece starts, and its host
        copies stop before their next op. Its result still comes once nothing of it runs
        (slots stay pinned until then). O(jobs in flight): a rare path."""
        loads = [*self._new_loads, *self._staged.values(),
                 *(r[0] for r in self._cpu_jobs.values() if isinstance(r, tuple)),
                 *(r.load for r in self._storage_jobs.values() if isinstance(r, Read))]
        load = next((x for x in loads if x.job_id == job_id), None)
        if load is None or load.closed:
            return
        self._fail_load(load)
        for cpu_job in host_copies_of(self._cpu_jobs, load):
            self.cpu.cancel(cpu_job)
        if not any(x is load for x in self._new_loads):  # (else: at its planning)
            self._finish_load_if_done(load)

    def _copy_to_engine(self, load: Load, keys: list[OffloadKey]) -> None:
        """Pin ready host keys and copy them into the load's engine blocks."""
        if not keys or load.closed:
            return
        slots = self.manager.prepare_load(keys)
        # Progress per layer only for a load copied in one piece: with several pieces a
        # layer copied by one is not yet copied by the others.
        whole = load.pending == 0 and len(keys) == len(load.targets)
        try:
            self._submit_cpu((load, keys), Direction.LOAD, transfers(keys, slots, load.targets),
                             load.ready, load.layers if whole else None, load.inline)
        except Exception:
            self.manager.complete_load(keys)
            raise
        load.pending += 1

    def _stage(self, load: Load) -> None:
        """Start reading the load's waiting storage keys, a batch at a time, as host room
        allows; a load that cannot get room before its deadline fails those keys."""
        while load.waiting and not load.closed:
            room = self.staging_slots - sum(len(r.keys) for r in load.reads)
            if room <= 0:  # the batches in flight free their slots as they reach the engine
                break
            batch = load.waiting[:room]
            plan = self.manager.prepare_store(batch)
            while plan is None and len(batch) > 1:  # take what room there is
                batch = batch[:len(batch) // 2]
                plan = self.manager.prepare_store(batch)
            if plan is None:  # no room now: retried at every poll until the deadline
                self._staged[load.job_id] = load
                if time.monotonic() - load.started > self.read_timeout_s:
                    self.faults.failed("staging", "no host room for a load before its deadline")
                    load.failed += load.waiting
                    load.waiting = []
                break
            del load.waiting[:len(batch)]
            ready = [k for k in plan.already_present if self.manager.is_ready(k)]
            load.awaiting += [k for k in plan.already_present if not self.manager.is_ready(k)]
            self._copy_to_engine(load, ready)
            if plan.keys:
                self._submit_read(load, plan.keys, plan.slots)
        self._take_awaited(load)
        if not (load.waiting or load.awaiting) or load.closed:
            self._staged.pop(load.job_id, None)
        else:  # re-checked at every poll
            self._staged[load.job_id] = load

    def _take_awaited(self, load: Load) -> None:
        """Copy the awaited keys that are ready in host slots now; fail those whose read
        failed (no slot any more) and, past the deadline, those still not there."""
        if not load.awaiting or load.closed:
            return
        late = time.monotonic() - load.started > self.read_timeout_s
        seen = (self.manager.settled, self._stores_ended)
        if seen == load.seen and not late:
            return  # no store completed or ended since the last check: none is ready
        load.seen = seen
        ready, still = [], []
        for key, state in zip(load.awaiting, self.manager.lookup(load.awaiting)):
            if state is SlotState.READY:
                ready.append(key)
            elif late or (state is SlotState.ABSENT and key not in self._storing):
                load.failed.append(key)  # (ABSENT: the read or the store that had it failed)
            else:
                still.append(key)
        load.awaiting = still
        self._copy_to_engine(load, ready)

    def _submit_read(self, load: Load, keys, slots) -> None:
        read = Read(load, tuple(keys), self._generation, time.monotonic())
        try:
            buffers = [self.cpu.slot_buffer(slot, key[1]) for key, slot in zip(keys, slots)]
            job = self.storage.submit_read([storage_key(k, self._generation) for k in keys],
                                           buffers)
        except Exception as exc:
            self.faults.failed("storage read", exc)
            self.manager.complete_store(list(keys), False)
            load.failed += keys
            return
        load.reads.append(read)
        load.pending += 1
        self._storage_jobs[job] = read
        self._reads[job] = read

    def _read_done(self, read: Read, succeeded: Sequence[bool]) -> None:
        load = read.load
        if not read.given_up:  # first: a fault below must not leave the load pending
            load.reads.remove(read)
            load.pending -= 1
        ok = [k for k, good in zip(read.keys, succeeded) if good]
        bad = [k for k, good in zip(read.keys, succeeded) if not good]
        group_bytes = self.cpu.layout.group_bytes
        self.read_rate.record(sum(group_bytes[k[1]] for k in ok), time.monotonic() - read.started)
        self.manager.complete_store(bad, False)
        self.manager.complete_store(ok, True)
        self._key_failures[Direction.LOAD] += len(bad)
        if read.generation == self._generation:
            self.view.storage_removed(bad)  # unreadable (vanished, corrupt): not a hit
        if read.given_up:  # the load went on without it: its bytes just stay in host slots
            return
        loaded = [k for k in ok if self.manager.is_ready(k)]  # a reset may have dropped some
        load.failed += bad + [k for k in ok if not self.manager.is_ready(k)]
        load.from_storage += len(loaded)
        self._copy_to_engine(load, loaded)
        self._stage(load)
        self._finish_load_if_done(load)

    def _load_copied(self, load: Load, keys: list[OffloadKey], success: bool) -> None:
        load.pending -= 1  # first: a fault below must not leave the load pending
        if not success:
            load.failed += keys
        self.manager.complete_load(keys)
        self._stage(load)
        self._finish_load_if_done(load)

    def _advance_staged(self) -> None:
        now = time.monotonic()
        for load in list(self._staged.values()):
            self._stage(load)
            self._finish_load_if_done(load)
        # Reads past their deadline: the oldest first, so O(reads given up), not O(jobs in
        # flight) (the storage jobs include every write-through still queued).
        while self._reads:
            job, record = next(iter(self._reads.items()))
            if now - record.started <= self.read_timeout_s:
                break  # the rest started later
            del self._reads[job]
            self.faults.failed("storage read", "a read passed its deadline")
            record.given_up = True  # its slots stay reserved until the tier answers
            load = record.load
            load.reads.remove(record)
            load.pending -= 1
            load.failed += record.keys
            self._stage(load)
            self._finish_load_if_done(load)

    def _fail_load(self, load: Load) -> None:
        load.closed = True
        load.failed = list(load.targets)
        self._staged.pop(load.job_id, None)

    def _finish_load_if_done(self, load: Load) -> None:
        """Deliver the load's result once nothing of it is in flight: even a load that
        failed whole waits for its copies, so vLLM never reuses blocks we still write."""
        if load.pending or ((load.waiting or load.awaiting) and not load.closed):
            return
        failed = blocks_of({k: load.targets[k] for k in dict.fromkeys(load.failed)})
        self._finish(TieredResult(load.job_id, Direction.LOAD, not failed and not load.closed,
                                  failed, load.from_storage))

