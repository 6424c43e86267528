"""TPRecordTier: a rank's view of a storage tier that holds TP-free records.

Above any `StorageTier` (filesystem, Valkey, S3, a plug-in: their contract is unchanged),
this tier speaks rank keys and host slot buffers to `TieredStore`, as every tier does, and
TP-free records (`tp_records`) to the tier below:

- **write** of a rank key: a head-sharded group's writer rank writes its own record (the
  slot buffer itself where the page is head-major, else packed into a buffer of its own);
  a replica that does not write (the MLA latent, replicated heads on ranks other than the
  first) writes nothing and reports success: the first replica writes the same bytes. Until
  it has, only this rank believes the block stored, and a hit needs every rank. Per-shape
  groups write the slot buffer under the shape-tagged key.
- **read** of a rank key: the records `GroupRecords.cover` picks from what is present, read
  whole, then the heads this rank holds copied into the slot buffer (the own record of a
  head-major page is read straight into it). The key succeeds only if every record read
  succeeded: a rank never loads part of its heads. A key not covered fails at once, no I/O.
- **presence**: per rank key (bytes, not tracked by the garbage collector), a bit per
  candidate record present, fed by our own writes and the tier's change feed; a rank key
  is added or removed when its coverage changes (O(changes); at most one rank key change per
  record change, so `take_changes` stays bounded). So `TieredStore`, the scheduler's per-rank
  key sets, hits and KV events keep working per block: a block counts as stored on a rank
  when every head it needs is.

Driven by one thread at a time, like the tier below (the connector's worker lock).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kv_offload.backends.base import (
    StorageTier,
    TierChanges,
    TierJobResult,
    TierStats,
    check_tier_request,
)
from kv_offload.tp_records import CoverPart, GroupRecords, RankRecords, aligned_buffer


@dataclass
class _KeyPlan:
    """One rank key of a job: the positions of its inner keys and, for a read that is not
    straight into the slot, the records to unpack (part, inner position, buffer)."""

    inner: list[int] = field(default_factory=list)
    unpack: list[tuple[CoverPart, int, torch.Tensor]] = field(default_factory=list)
    record_bits: list[int] = field(default_factory=list)  # candidates this key read
    written_bit: bool = False  # a write of the own record: mark it present on success


@dataclass
class _Job:
    job_id: int
    keys: tuple[bytes, ...]
    buffers: Sequence[torch.Tensor]
    plans: list[_KeyPlan | None]  # None: failed (or skipped, `skipped_ok`) without I/O
    skipped_ok: list[bool]
    temps: list[torch.Tensor] = field(default_factory=list)  # kept alive until the job ends


SPARE_BUFFER_BYTES = 64 << 20  # record buffers kept for reuse (fresh pages fault on first touch)


class _Buffers:
    """Record buffers for packed writes and whole-record reads, reused by size: a fresh
    allocation of a few MiB is fresh pages that the kernel zeroes on first touch, which cost
    more than the copy into them. Keeps at most `SPARE_BUFFER_BYTES` spare."""

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

    def take_changes(self, max_keys: int) -> TierChanges:
        changes = self.inner.take_changes(max_keys)
        latest: dict[bytes, bool] = {}
        for inner_keys, on in ((changes.removed, False), (changes.added, True)):
            for inner_key in inner_keys:
                parsed = self.records.parse(inner_key)
                if parsed is None:
                    continue
                key, group, heads = parsed
                if heads is None:  # a per-shape key of this shape
                    latest[key] = on
                    continue
                recs = self.records.groups[group]
                if heads not in recs.candidates:
                    continue  # a range no TP size of ours reads (e.g. other heads entirely)
                before = self._covered(key, group)
                self._set_bit(key, recs.candidates.index(heads), on)
                if self._covered(key, group) != before:
                    latest[key] = not before
        return TierChanges(tuple(k for k, on in latest.items() if on),
                           tuple(k for k, on in latest.items() if not on))

    # --- jobs ---

    def submit_write(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        check_tier_request(keys, buffers)
        job = _Job(next(self._ids), tuple(keys), buffers, [], [])
        inner_keys, inner_buffers = [], []
        for key, buffer in zip(keys, buffers):
            group = self.records.group_of(key)
            recs = None if group is None else self.records.groups[group]
            plan = _KeyPlan()
            if group is None:
                plan = None
            elif recs is None:
                plan.inner.append(len(inner_keys))
                inner_keys.append(self.records.shape_key(key))
                inner_buffers.append(buffer)
            elif recs.shard.writes:
                record = buffer if recs.identity else \
                    self._buffers.take(recs.record_bytes(recs.own))
                if not recs.identity:
                    recs.pack(buffer.view(torch.int8), record)
                    job.temps.append(record)
                plan.inner.append(len(inner_keys))
                plan.written_bit = True
                inner_keys.append(self.records.record_key(key, recs.own))
                inner_buffers.append(record)
            else:  # another replica writes these heads
                plan = None
            job.plans.append(plan)
            job.skipped_ok.append(group is not None)
        return self._submit(job, inner_keys, inner_buffers, self.inner.submit_write)

    def submit_read(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        check_tier_request(keys, buffers)
        job = _Job(next(self._ids), tuple(keys), buffers, [], [])
        inner_keys, inner_buffers = [], []
        for key, buffer in zip(keys, buffers):
            group = self.records.group_of(key)
            recs = None if group is None else self.records.groups[group]
            cover = None if recs is None else self._cover(group, self._present.get(key, 0))
            plan = _KeyPlan()
            if group is None or (recs is not None and cover is None):
                plan = None  # not ours / not covered: a miss without I/O
            elif recs is None:
                plan.inner.append(len(inner_keys))
                inner_keys.append(self.records.shape_key(key))
                inner_buffers.append(buffer)
            else:
                for part in cover:
                    plan.inner.append(len(inner_keys))
                    plan.record_bits.append(recs.candidates.index(part.record))
                    inner_keys.append(self.records.record_key(key, part.record))
                    if recs.identity and part.record == part.take == recs.own:
                        inner_buffers.append(buffer)  # straight into the slot
                        continue
                    temp = self._buffers.take(recs.record_bytes(part.record))
                    job.temps.append(temp)
                    plan.unpack.append((part, len(inner_buffers), temp))
                    inner_buffers.append(temp)
            job.plans.append(plan)
            job.skipped_ok.append(False)
        return self._submit(job, inner_keys, inner_buffers, self.inner.submit_read)

    def _submit(self, job: _Job, inner_keys, inner_buffers, submit) -> int:
        if not inner_keys:  # nothing to do below: the result is known now
            self._done.append(TierJobResult(job.job_id, job.keys, tuple(job.skipped_ok)))
            return job.job_id
        self._jobs[submit(inner_keys, inner_buffers)] = job
        return job.job_id

    def poll(self) -> list[TierJobResult]:
        for result in self.inner.poll():
            job = self._jobs.pop(result.job_id, None)
            if job is not None:
                self._done.append(self._finish(job, result.succeeded))
        done, self._done = self._done, []
        return done

    def _finish(self, job: _Job, succeeded: Sequence[bool]) -> TierJobResult:
        flags = []
        for key, buffer, plan, skipped_ok in zip(job.keys, job.buffers, job.plans,
                                                 job.skipped_ok):
            if plan is None:
                flags.append(skipped_ok)
                continue
            ok = all(succeeded[i] for i in plan.inner)
            group = self.records.group_of(key)
            recs: GroupRecords | None = self.records.groups[group]
            if plan.written_bit and ok:
                self._set_bit(key, 0, True)
            for bit, i in zip(plan.record_bits, plan.inner):
                if not succeeded[i]:  # vanished or bad: no longer counted present
                    self._set_bit(key, bit, False)
            if ok and plan.unpack:
                target = buffer.view(torch.int8)
                for part, _, temp in plan.unpack:
                    recs.unpack(temp, part, target)
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
        return list(dict.fromkeys(k for k, g, heads in parsed
                                  if heads is None or self._covered(k, g)))

    def clear(self) -> None:
        self.inner.clear()
        self._present.clear()

    def stats(self) -> TierStats:
        return self.inner.stats()

    def describe(self) -> str:
        return f"{self.inner.describe()}, TP-free head records"

    def discard(self, keys: Sequence[bytes]) -> None:
        """Discard what a read of these rank keys would read (their records, shape keys)."""
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
        if inner:
            self.inner.discard(inner)

    def read_generation(self) -> bytes | None:
        return self.inner.read_generation()

    def write_generation(self, record: bytes) -> bool:
        return self.inner.write_generation(record)
