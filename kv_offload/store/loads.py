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

The pipeline owns the loads in flight: those submitted and not yet planned, those waiting for
host room or for keys another job brings (`staged`), and the storage reads not yet given up.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kv_offload.kernels.runtime import EngineReady
from kv_offload.store.host.layer_copies import LayerSteps
from kv_offload.store.jobs import (
    Load,
    LoadPiece,
    Read,
    TieredResult,
    blocks_of,
    targets_of,
    transfers,
)
from kv_offload.store.manager import SlotState
from kv_offload.store.shared import JobBook, Tiers
from kv_offload.store.stores import StorePipeline
from kv_offload.types import Direction, GroupBlocks, Location, OffloadKey


class LoadPipeline:
    """The loads of a `TieredStore`: host keys into the engine, storage keys staged."""

    def __init__(self, tiers: Tiers, book: JobBook, stores: StorePipeline, *,
                 read_timeout_s: float, staging_slots: int) -> None:
        self._tiers = tiers
        self._book = book
        self._stores = stores  # (what stores in flight carry: a load awaits those keys)
        self.read_timeout_s = read_timeout_s
        self.staging_slots = staging_slots
        self._new: list[Load] = []  # submitted, not yet planned
        self.staged: dict[int, Load] = {}  # loads waiting for host room or awaited keys
        self._reads: dict[int, Read] = {}  # reads in flight, not given up, oldest first

    def submit(self, requests: GroupBlocks, ready: EngineReady | None,
               layers: LayerSteps | None, inline: bool) -> int:
        """Take a load (O(blocks) of bookkeeping: on the engine's step path); it is planned
        at the next `plan_new`, first thing in the pump's poll, so its host keys are pinned
        before that poll stages any store."""
        load = Load(self._book.new_job(), {}, time.monotonic(), ready=ready, layers=layers,
                    inline=inline)
        try:
            load.targets = targets_of(requests)
        except Exception as exc:
            self._tiers.faults.failed("load planning", exc)
            self.fail(load)
            return load.job_id
        self._new.append(load)
        return load.job_id

    @property
    def busy(self) -> bool:
        return bool(self._new or self.staged)

    def awaited_keys(self) -> set[OffloadKey]:
        """Keys some staged load awaits (another job is bringing them into host slots)."""
        return {k for load in self.staged.values() for k in load.awaiting}

    def count_from_storage(self, keys: set[OffloadKey]) -> None:
        """These awaited keys were read from the storage tier by another job (the probe):
        the loads awaiting them count them as storage hits."""
        for load in self.staged.values():
            load.from_storage += sum(k in keys for k in load.awaiting)

    def plan_new(self) -> None:
        """Start the loads submitted since the last poll: host keys are pinned and copied
        into the engine at once, storage keys are read into host slots (staged)."""
        loads, self._new = self._new, []
        storing = self._stores.storing
        for load in loads:
            if load.closed:  # (given up before it was planned)
                self._finish_if_done(load)
                continue
            try:
                keys = list(load.targets)
                where = self._tiers.lookup(keys)
                on_host = [k for k, w in zip(keys, where) if w is Location.HOST]
                load.waiting = [k for k, w in zip(keys, where) if w is Location.STORAGE]
                absent = [k for k, w in zip(keys, where) if w is Location.ABSENT]
                # A key a store in flight is putting in a host slot: copied once it lands.
                load.awaiting = [k for k in absent if k in storing]
                load.failed = [k for k in absent if k not in storing]
                self._copy_to_engine(load, on_host)
                self._tiers.manager.touch(on_host)
                self._stage(load)
            except Exception as exc:  # this load fails; the others go on
                self._tiers.faults.failed("load planning", exc)
                self._close(load)
            self._finish_if_done(load)

    def abandon(self, job_id: int) -> None:
        """The caller stopped waiting for this load (an in-step load past its bound, whose
        blocks vLLM recomputes): it fails whole, no further piece starts, and its host
        copies stop before their next op. Its result still comes once nothing of it runs
        (slots stay pinned until then). O(jobs in flight): a rare path."""
        book = self._book
        loads = [*self._new, *self.staged.values(),
                 *(r.load for r in book.cpu_jobs.values() if isinstance(r, LoadPiece)),
                 *(r.load for r in book.storage_jobs.values() if isinstance(r, Read))]
        load = next((x for x in loads if x.job_id == job_id), None)
        if load is None or load.closed:
            return
        self._close(load)
        for cpu_job in book.copies_of(load):
            self._tiers.cpu.cancel(cpu_job)
        if not any(x is load for x in self._new):  # (else: at its planning)
            self._finish_if_done(load)

    def fail(self, load: Load) -> None:
        """A fault in this load's bookkeeping: it fails whole; its result comes once
        nothing of it is in flight."""
        self._close(load)
        self._finish_if_done(load)

    def _copy_to_engine(self, load: Load, keys: list[OffloadKey]) -> None:
        """Pin ready host keys and copy them into the load's engine blocks."""
        if not keys or load.closed:
            return
        manager = self._tiers.manager
        slots = manager.prepare_load(keys)
        # Progress per layer only for a load copied in one piece: with several pieces a
        # layer copied by one is not yet copied by the others.
        whole = load.pending == 0 and len(keys) == len(load.targets)
        try:
            self._book.submit_copy(LoadPiece(load, keys), Direction.LOAD,
                                   transfers(keys, slots, load.targets), load.ready,
                                   load.layers if whole else None, load.inline)
        except Exception:
            manager.complete_load(keys)
            raise
        load.pending += 1

    def _stage(self, load: Load) -> None:
        """Start reading the load's waiting storage keys, a batch at a time, as host room
        allows; a load that cannot get room before its deadline fails those keys."""
        manager = self._tiers.manager
        while load.waiting and not load.closed:
            room = self.staging_slots - sum(len(r.keys) for r in load.reads)
            if room <= 0:  # the batches in flight free their slots as they reach the engine
                break
            batch = load.waiting[:room]
            plan = manager.prepare_store(batch)
            while plan is None and len(batch) > 1:  # take what room there is
                batch = batch[:len(batch) // 2]
                plan = manager.prepare_store(batch)
            if plan is None:  # no room now: retried at every poll until the deadline
                self.staged[load.job_id] = load
                if time.monotonic() - load.started > self.read_timeout_s:
                    self._tiers.faults.failed("staging",
                                              "no host room for a load before its deadline")
                    load.failed += load.waiting
                    load.waiting = []
                break
            del load.waiting[:len(batch)]
            ready = [k for k in plan.already_present if manager.is_ready(k)]
            load.awaiting += [k for k in plan.already_present if not manager.is_ready(k)]
            self._copy_to_engine(load, ready)
            if plan.keys:
                self._submit_read(load, plan.keys, plan.slots)
        self._take_awaited(load)
        if not (load.waiting or load.awaiting) or load.closed:
            self.staged.pop(load.job_id, None)
        else:  # re-checked at every poll
            self.staged[load.job_id] = load

    def _take_awaited(self, load: Load) -> None:
        """Copy the awaited keys that are ready in host slots now; fail those whose read
        failed (no slot any more) and, past the deadline, those still not there."""
        if not load.awaiting or load.closed:
            return
        late = time.monotonic() - load.started > self.read_timeout_s
        manager, storing = self._tiers.manager, self._stores.storing
        seen = (manager.settled, self._stores.ended)
        if seen == load.seen and not late:
            return  # no store completed or ended since the last check: none is ready
        load.seen = seen
        ready, still = [], []
        for key, state in zip(load.awaiting, manager.lookup(load.awaiting)):
            if state is SlotState.READY:
                ready.append(key)
            elif late or (state is SlotState.ABSENT and key not in storing):
                load.failed.append(key)  # (ABSENT: the read or the store that had it failed)
            else:
                still.append(key)
        load.awaiting = still
        self._copy_to_engine(load, ready)

    def _submit_read(self, load: Load, keys, slots) -> None:
        tiers = self._tiers
        read = Read(load, tuple(keys), tiers.generation, time.monotonic())
        try:
            job = tiers.read_into_slots(keys, slots)
        except Exception as exc:
            tiers.faults.failed("storage read", exc)
            tiers.manager.complete_store(list(keys), False)
            load.failed += keys
            return
        load.reads.append(read)
        load.pending += 1
        self._book.storage_jobs[job] = read
        self._reads[job] = read

    def read_done(self, job: int, read: Read, succeeded: Sequence[bool]) -> None:
        self._reads.pop(job, None)
        tiers, manager = self._tiers, self._tiers.manager
        load = read.load
        if not read.given_up:  # first: a fault below must not leave the load pending
            load.reads.remove(read)
            load.pending -= 1
        ok = [k for k, good in zip(read.keys, succeeded) if good]
        bad = [k for k, good in zip(read.keys, succeeded) if not good]
        group_bytes = tiers.cpu.layout.group_bytes
        tiers.read_rate.record(sum(group_bytes[k[1]] for k in ok),
                               time.monotonic() - read.started)
        manager.complete_store(bad, False)
        manager.complete_store(ok, True)
        tiers.key_failures[Direction.LOAD] += len(bad)
        if read.generation == tiers.generation:
            tiers.view.storage_removed(bad)  # unreadable (vanished, corrupt): not a hit
        if read.given_up:  # the load went on without it: its bytes just stay in host slots
            return
        loaded = [k for k in ok if manager.is_ready(k)]  # a reset may have dropped some
        load.failed += bad + [k for k in ok if not manager.is_ready(k)]
        load.from_storage += len(loaded)
        self._copy_to_engine(load, loaded)
        self._stage(load)
        self._finish_if_done(load)

    def piece_copied(self, piece: LoadPiece, success: bool) -> None:
        load = piece.load
        load.pending -= 1  # first: a fault below must not leave the load pending
        if not success:
            load.failed += piece.keys
        self._tiers.manager.complete_load(piece.keys)
        self._stage(load)
        self._finish_if_done(load)

    def advance(self) -> None:
        """At a poll: stage what host room allows; give up reads past their deadline."""
        now = time.monotonic()
        for load in list(self.staged.values()):
            self._stage(load)
            self._finish_if_done(load)
        # Reads past their deadline: the oldest first, so O(reads given up), not O(jobs in
        # flight) (the storage jobs include every write-through still queued).
        while self._reads:
            job, record = next(iter(self._reads.items()))
            if now - record.started <= self.read_timeout_s:
                break  # the rest started later
            del self._reads[job]
            self._tiers.faults.failed("storage read", "a read passed its deadline")
            record.given_up = True  # its slots stay reserved until the tier answers
            load = record.load
            load.reads.remove(record)
            load.pending -= 1
            load.failed += record.keys
            self._stage(load)
            self._finish_if_done(load)

    def _close(self, load: Load) -> None:
        load.closed = True
        load.failed = list(load.targets)
        self.staged.pop(load.job_id, None)

    def _finish_if_done(self, load: Load) -> None:
        """Deliver the load's result once nothing of it is in flight: even a load that
        failed whole waits for its copies, so vLLM never reuses blocks we still write."""
        if load.pending or ((load.waiting or load.awaiting) and not load.closed):
            return
        failed = blocks_of({k: load.targets[k] for k in dict.fromkeys(load.failed)})
        self._book.finish(TieredResult(load.job_id, Direction.LOAD,
                                       not failed and not load.closed, failed,
                                       load.from_storage))
