"""TPRecordTier: a rank's view of a storage tier that holds TP-free records.

Above any `StorageTier` (filesystem, Valkey, S3, a plug-in: their contract is unchanged),
this tier speaks rank keys and host slot buffers to `TieredStore`, as every tier does, and
TP-free records (`tp.records`) to the tier below:

- **write** of a rank key: a head-sharded group's writer rank writes its own record (the
  slot buffer itself where the record's order is the page's: LBHNC and LBNHC pages with dense
  slots, `tp.records.own_record`; else packed into a buffer of its own);
  a replica that does not write (the MLA latent, replicated heads on ranks other than the
  first) writes nothing and reports success: the first replica writes the same bytes. Until
  it has, only this rank believes the block stored, and a hit needs every rank. Per-shape
  groups write the slot buffer under the shape-tagged key.
- **read** of a rank key: the records `GroupRecords.cover` picks from what is present, read
  whole, then the heads this rank holds copied into the slot buffer (the own record, where
  it is the slot's bytes, is read straight into it). The key succeeds only if every record read
  succeeded: a rank never loads part of its heads. A key not covered fails at once, no I/O.
- **presence**: per rank key (bytes, not tracked by the garbage collector), a bit per
  candidate record present, fed by our own writes and the tier's change feed; a rank key
  is added or removed when its coverage changes (O(changes); at most one rank key change per
  record change, so `take_changes` stays bounded). So `TieredStore`, the scheduler's per-rank
  key sets, hits and KV events keep working per block: a block counts as stored on a rank
  when every head it needs is. `find` asks the tier below about every candidate record of
  the rank keys asked (a targeted question, for keys another server stored moments ago) and
  marks those found present; the rank keys it covered are reported by the next
  `take_changes`.
- **copies** (a record that is not the slot's bytes: a part of a larger record, a record of
  another rank's order, pages with padding or split LBHNC kernel blocks):
  handed to the tier below as `base.Repack` values (`_RecordCopy`). The filesystem tier
  packs and unpacks them on its I/O threads, in one buffer per thread that it keeps (memory:
  `io_threads` x the largest record; the copies overlap other keys' I/O, as the copy-free
  path's transfers do, and no page is first touched per record). A tier that takes
  buffers only (the default hook returns None) gets buffers of ours (`_Buffers`), packed at
  submit and unpacked at `poll`, `SPARE_BUFFER_BYTES` of them kept for reuse.

Driven by one thread at a time, like the tier below (the connector's worker lock).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kv_offload.backends.base import (
    Repack,
    StorageTier,
    TierChanges,
    TierJobResult,
    TierStats,
    check_tier_request,
)
from kv_offload.store.tp.records import CoverPart, GroupRecords, RankRecords, aligned_buffer


@dataclass
class _KeyPlan:
    """One rank key of a job: the positions of its inner keys, and the records it unpacks
    here (a tier that takes buffers only: record, buffer it was read into)."""

    inner: list[int] = field(default_factory=list)
    unpack: list[tuple[_RecordCopy, torch.Tensor]] = field(default_factory=list)
    record_bits: list[int] = field(default_factory=list)  # candidates this key read
    written_bit: bool = False  # a write of the own record: mark it present on success


@dataclass
class _Job:
    job_id: int
    keys: tuple[bytes, ...]
    plans: list[_KeyPlan | None] = field(default_factory=list)  # None: no I/O (failed, or
    skipped_ok: list[bool] = field(default_factory=list)        # skipped: `skipped_ok`)
    temps: list[torch.Tensor] = field(default_factory=list)  # kept alive until the job ends


@dataclass
class _FindPlan:
    """One rank key of a `find`: its group, and the positions of the inner keys asked for
    it (its candidate records, in bit order; or its shape key)."""

    group: int
    asks: list[int]


@dataclass
class _Entry:
    """One rank key of a request: its slot buffer, group and records (None: per shape)."""

    key: bytes
    buffer: torch.Tensor
    group: int | None  # None: not a group of this model
    recs: GroupRecords | None


@dataclass
class _Inner:
    """The request to the tier below: keys, values, and the plan each value belongs to."""

    keys: list[bytes] = field(default_factory=list)
    values: list[torch.Tensor | Repack] = field(default_factory=list)
    owners: list[_KeyPlan] = field(default_factory=list)

    def add(self, plan: _KeyPlan, key: bytes, value: torch.Tensor | Repack) -> None:
        plan.inner.append(len(self.keys))
        self.keys.append(key)
        self.values.append(value)
        self.owners.append(plan)


@dataclass
class _RecordCopy(Repack):
    """A record of `part.record` packed from (this rank's own) or unpacked into (heads
    `part.take`) a host slot: by the tier below on its I/O thread, or here (`_Buffers`)."""

    recs: GroupRecords
    part: CoverPart
    slot: torch.Tensor  # the host slot buffer, int8

    @property
    def nbytes(self) -> int:
        return self.recs.record_bytes(self.part.record)

    def pack(self, out: torch.Tensor) -> None:
        self.recs.pack(self.slot, out.view(torch.int8))

    def unpack(self, stored: torch.Tensor) -> None:
        self.recs.unpack(stored.view(torch.int8), self.part, self.slot)


SPARE_BUFFER_BYTES = 64 << 20  # record buffers kept for reuse (fresh pages fault on first touch)


class _Buffers:
    """Record buffers for a tier that takes buffers only (no `Repack`s): packed writes and
    whole-record reads, reused by size: a fresh allocation of a few MiB is fresh pages that
    the kernel zeroes on first touch, which cost more than the copy into them. Keeps at
    most `SPARE_BUFFER_BYTES` spare."""

    def __init__(self) -> None:
        self._spare: dict[int, list[torch.Tensor]] = {}
        self._spare_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        spare = self._spare.get(nbytes)
        if spare:
            self._spare_bytes -= nbytes
            return spare.pop()
        return aligned_buffer(nbytes)

    def give(self, buffers: list[torch.Tensor]) -> None:
        for buffer in buffers:
            if self._spare_bytes + buffer.numel() <= SPARE_BUFFER_BYTES:
                self._spare.setdefault(buffer.numel(), []).append(buffer)
                self._spare_bytes += buffer.numel()


class TPRecordTier(StorageTier):
    """`inner` holding TP-free records, seen by one rank (see the module docstring)."""

    def __init__(self, inner: StorageTier, records: RankRecords) -> None:
        self.inner, self.records = inner, records
        self._present: dict[bytes, int] = {}  # rank key -> bit per candidate record present
        self._found: dict[bytes, None] = {}  # rank keys `find` made covered, not yet reported
        self._covers: list[dict[int, tuple[CoverPart, ...] | None]] = \
            [{} for _ in records.groups]  # per group: bits -> cover (memoised)
        self._ids = itertools.count(1)
        self._jobs: dict[int, _Job] = {}  # by inner job id
        self._done: list[TierJobResult] = []
        self._buffers = _Buffers()

    # --- presence ---

    def _cover(self, group: int, bits: int) -> tuple[CoverPart, ...] | None:
        memo = self._covers[group]
        if bits not in memo:
            memo[bits] = self.records.groups[group].cover(lambda i: bool(bits >> i & 1))
        return memo[bits]

    def _covered(self, key: bytes, group: int) -> bool:
        bits = self._present.get(key, 0)
        return bool(bits) and self._cover(group, bits) is not None

    def _set_bit(self, key: bytes, bit: int, on: bool) -> None:
        bits = self._present.get(key, 0)
        bits = bits | 1 << bit if on else bits & ~(1 << bit)
        if bits:
            self._present[key] = bits
        else:
            self._present.pop(key, None)

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        found = []
        for key in keys:
            group = self.records.group_of(key)
            if group is None:
                found.append(False)
            elif self.records.groups[group] is None:
                found.append(self.inner.lookup([self.records.shape_key(key)])[0])
            else:
                found.append(self._covered(key, group))
        return found

    def find(self, keys: Sequence[bytes]) -> list[bool]:
        """Ask the tier below about every record that could serve each rank key (its
        candidates, the bits `lookup` reads; a per-shape key: its shape key), in one call.
        Records found are marked present (the tier below adopted them too), so `lookup`
        answers from them at once; a rank key they made covered is reported added by the
        next `take_changes` (their own "added" from the tier below then changes nothing
        here). A rank key is found when the records found cover it."""
        asks: list[bytes] = []
        plans: list[_FindPlan | None] = []
        for key in keys:
            group = self.records.group_of(key)
            if group is None:
                plans.append(None)
                continue
            recs = self.records.groups[group]
            if recs is None:
                plans.append(_FindPlan(group, [len(asks)]))
                asks.append(self.records.shape_key(key))
                continue
            plans.append(_FindPlan(group, list(range(len(asks), len(asks) + len(
                recs.candidates)))))
            asks += [self.records.record_key(key, record) for record in recs.candidates]
        found = self.inner.find(asks) if asks else []
        answers = []
        for key, plan in zip(keys, plans):
            if plan is None:
                answers.append(False)
            elif self.records.groups[plan.group] is None:  # (the tier below's feed says it)
                answers.append(found[plan.asks[0]])
            else:
                bits = sum(1 << bit for bit, at in enumerate(plan.asks) if found[at])
                before = self._covered(key, plan.group)
                for bit in range(len(plan.asks)):
                    if bits >> bit & 1:
                        self._set_bit(key, bit, True)
                if not before and self._covered(key, plan.group):
                    self._found[key] = None
                answers.append(bool(bits) and self._cover(plan.group, bits) is not None)
        return answers

    def take_changes(self, max_keys: int) -> TierChanges:
        latest: dict[bytes, bool] = {}
        # Rank keys `find` made covered first (their records' "added" from below, which
        # may come in this very call, no longer changes their coverage).
        for key in list(itertools.islice(self._found, max_keys)):
            del self._found[key]
            latest[key] = True
        if len(latest) >= max_keys:
            return TierChanges(tuple(latest), ())
        changes = self.inner.take_changes(max_keys - len(latest))
        for inner_keys, on in ((changes.removed, False), (changes.added, True)):
            for inner_key in inner_keys:
                parsed = self.records.parse(inner_key)
                if parsed is None:
                    continue
                key, group, record = parsed
                if record is None:  # a per-shape key of this shape
                    latest[key] = on
                    continue
                recs = self.records.groups[group]
                if record not in recs.candidates:
                    continue  # a record no TP size of ours reads (e.g. other heads entirely)
                before = self._covered(key, group)
                self._set_bit(key, recs.candidates.index(record), on)
                if self._covered(key, group) != before:
                    latest[key] = not before
        return TierChanges(tuple(k for k, on in latest.items() if on),
                           tuple(k for k, on in latest.items() if not on))

    # --- jobs ---

    def _open(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]
              ) -> tuple[_Job, list[_Entry]]:
        """A job for a request of rank keys, and its keys with their groups and records."""
        check_tier_request(keys, buffers)
        entries = []
        for key, buffer in zip(keys, buffers):
            group = self.records.group_of(key)
            recs = None if group is None else self.records.groups[group]
            entries.append(_Entry(key, buffer, group, recs))
        return _Job(next(self._ids), tuple(keys)), entries

    def submit_write(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        job, entries = self._open(keys, buffers)
        inner = _Inner()
        for e in entries:
            plan: _KeyPlan | None = _KeyPlan()
            if e.group is None:
                plan = None
            elif e.recs is None:
                inner.add(plan, self.records.shape_key(e.key), e.buffer)
            elif e.recs.shard.writes:
                own = e.recs.own
                record = e.buffer if e.recs.identity else \
                    _RecordCopy(e.recs, CoverPart(own, own.heads), e.buffer.view(torch.int8))
                plan.written_bit = True
                inner.add(plan, self.records.record_key(e.key, own), record)
            else:  # another replica writes these heads
                plan = None
            job.plans.append(plan)
            job.skipped_ok.append(e.group is not None)
        return self._submit(job, inner, write=True)

    def submit_read(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        job, entries = self._open(keys, buffers)
        inner = _Inner()
        for e in entries:
            recs = e.recs
            cover = None if recs is None else self._cover(e.group, self._present.get(e.key, 0))
            plan: _KeyPlan | None = _KeyPlan()
            if e.group is None or (recs is not None and cover is None):
                plan = None  # not ours / not covered: a miss without I/O
            elif recs is None:
                inner.add(plan, self.records.shape_key(e.key), e.buffer)
            else:
                for part in cover:
                    plan.record_bits.append(recs.candidates.index(part.record))
                    straight = recs.identity and part.record == recs.own and \
                        part.take == recs.own.heads
                    inner.add(plan, self.records.record_key(e.key, part.record),
                              e.buffer if straight else  # straight into the slot
                              _RecordCopy(recs, part, e.buffer.view(torch.int8)))
            job.plans.append(plan)
            job.skipped_ok.append(False)
        return self._submit(job, inner, write=False)

    def _submit(self, job: _Job, inner: _Inner, write: bool) -> int:
        if not inner.keys:  # nothing to do below: the result is known now
            self._done.append(TierJobResult(job.job_id, job.keys, tuple(job.skipped_ok)))
            return job.job_id
        below = self.inner
        inner_id = None
        if any(isinstance(v, _RecordCopy) for v in inner.values):  # copied by the tier's
            inner_id = (below.submit_write_repacked if write else  # I/O threads, if it can
                        below.submit_read_repacked)(inner.keys, inner.values)
        if inner_id is None:
            values = [v if not isinstance(v, _RecordCopy) else self._copy_here(job, v, plan,
                                                                              write)
                      for v, plan in zip(inner.values, inner.owners)]
            inner_id = (below.submit_write if write else below.submit_read)(inner.keys, values)
        self._jobs[inner_id] = job
        return job.job_id

    def _copy_here(self, job: _Job, record: _RecordCopy, plan: _KeyPlan,
                   write: bool) -> torch.Tensor:
        """A buffer of ours for a record the tier below cannot repack: packed now (a
        write), or unpacked when the key's records all arrived (a read, `_finish`)."""
        buffer = self._buffers.take(record.nbytes)
        job.temps.append(buffer)
        if write:
            record.pack(buffer)
        else:
            plan.unpack.append((record, buffer))
        return buffer

    def poll(self) -> list[TierJobResult]:
        for result in self.inner.poll():
            job = self._jobs.pop(result.job_id, None)
            if job is not None:
                self._done.append(self._finish(job, result.succeeded))
        done, self._done = self._done, []
        return done

    def _finish(self, job: _Job, succeeded: Sequence[bool]) -> TierJobResult:
        flags = []
        for key, plan, skipped_ok in zip(job.keys, job.plans, job.skipped_ok):
            if plan is None:
                flags.append(skipped_ok)
                continue
            ok = all(succeeded[i] for i in plan.inner)
            if plan.written_bit and ok:
                self._set_bit(key, 0, True)
            for bit, i in zip(plan.record_bits, plan.inner):
                if not succeeded[i]:  # vanished or bad: no longer counted present
                    self._set_bit(key, bit, False)
            if ok:
                for record, temp in plan.unpack:
                    record.unpack(temp)
            flags.append(ok)
        self._buffers.give(job.temps)  # (the tier below is done with them)
        return TierJobResult(job.job_id, job.keys, tuple(flags))

    # --- the rest passes through ---

    def close(self) -> None:
        self.inner.close()
        for result in self.inner.poll():  # (jobs that ended while closing stay pollable)
            job = self._jobs.pop(result.job_id, None)
            if job is not None:
                self._done.append(self._finish(job, result.succeeded))

    def keys(self) -> list[bytes] | None:
        held = self.inner.keys()
        if held is None:
            return None
        parsed = [p for p in map(self.records.parse, held) if p is not None]
        return list(dict.fromkeys(k for k, g, record in parsed
                                  if record is None or self._covered(k, g)))

    def clear(self) -> None:
        self.inner.clear()
        self._present.clear()
        self._found.clear()

    def stats(self) -> TierStats:
        return self.inner.stats()

    def describe(self) -> str:
        return f"{self.inner.describe()}, TP-free head records"

    def discard(self, keys: Sequence[bytes]) -> None:
        """Discard what a read of these rank keys would read (their records, shape keys)."""
        inner = self._read_keys(keys)
        if inner:
            self.inner.discard(inner)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Touch what a read of these rank keys would read, in their order."""
        inner = self._read_keys(keys)
        if inner:
            self.inner.touch(inner)

    def _read_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The inner keys a read of these rank keys reads (records, or shape keys)."""
        inner = []
        for key in keys:
            group = self.records.group_of(key)
            if group is None:
                continue
            recs = self.records.groups[group]
            if recs is None:
                inner.append(self.records.shape_key(key))
                continue
            cover = self._cover(group, self._present.get(key, 0)) or ()
            inner += [self.records.record_key(key, part.record) for part in cover]
        return inner

    def read_generation(self) -> bytes | None:
        return self.inner.read_generation()

    def write_generation(self, record: bytes) -> bool:
        return self.inner.write_generation(record)

    def create_generation(self, record: bytes) -> bytes | None:
        return self.inner.create_generation(record)
