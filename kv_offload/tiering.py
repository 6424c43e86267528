"""TieredStore: the host-memory tier in front of an optional storage tier (disk).

Stores land in host slots (CpuBackend) and are then written through to the
storage tier in the background; host eviction therefore loses nothing the
storage tier holds. A key found only in the storage tier is first read into a
host slot, then loaded into the engine like any host hit. Every job ends with a
`TieredResult` that names the engine blocks whose bytes did not arrive: the
engine recomputes those, nothing else is affected.

Driven from one thread (the connector's worker side): submit jobs, then `poll`.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import xxhash

from kv_offload.backends.base import StorageTier
from kv_offload.backends.cpu import CpuBackend
from kv_offload.canonical import CanonicalKVCaches
from kv_offload.config import OffloadConfig
from kv_offload.manager import OffloadKey, OffloadManager

# {group: (block hashes, engine block ids)}; pair i is hash i <-> block i.
Requests = Mapping[int, tuple[Sequence[bytes | int], Sequence[int]]]


class Location(enum.Enum):
    HOST = "host"  # ready in a host slot
    STORAGE = "storage"  # only in the storage tier: loading reads it into a slot first
    ABSENT = "absent"


@dataclass(frozen=True)
class TieredResult:
    """The outcome of one store or load. `failed` maps group -> engine block ids whose
    bytes did not arrive (load: recompute them; store: they were not offloaded)."""

    job_id: int
    kind: str  # "store" | "load"
    success: bool
    failed: dict[int, list[int]] = field(default_factory=dict)
    from_storage: int = 0  # load: keys read from the storage tier (the rest came from host)
    no_room: bool = False  # store: skipped whole, the host tier could not make room


def layout_fingerprint(canonical: CanonicalKVCaches, extra: str = "") -> str:
    """A stable name for the page layout (plus e.g. model, TP size and rank in `extra`):
    bytes stored under one fingerprint are never served to another."""
    return xxhash.xxh3_64_hexdigest(repr((canonical.layout_signature(), extra)).encode())


def storage_key(key: OffloadKey) -> bytes:
    """The storage tier's opaque key for (block hash, group)."""
    block_hash, group = key
    if isinstance(block_hash, int):
        block_hash = block_hash.to_bytes(32, "little", signed=block_hash < 0)
    return bytes(block_hash) + group.to_bytes(2, "little")


def offload_key(key: bytes) -> tuple[bytes, int]:
    """The inverse of `storage_key` (block hashes come back as bytes)."""
    return key[:-2], int.from_bytes(key[-2:], "little")


@dataclass
class _Load:
    """A load in flight: which blocks each key fills, and what is pinned."""

    job_id: int
    targets: dict[OffloadKey, list[int]]  # key -> engine block ids
    pinned: list[OffloadKey] = field(default_factory=list)
    failed: list[OffloadKey] = field(default_factory=list)
    from_storage: int = 0


class TieredStore:
    """Host slots (with their manager) in front of an optional `StorageTier`."""

    def __init__(self, canonical: CanonicalKVCaches, cpu_bytes_to_use: int, *,
                 storage: StorageTier | None = None, eviction_policy: str = "lru",
                 pin: bool | None = None) -> None:
        self.cpu = CpuBackend(canonical, cpu_bytes_to_use, pin=pin)
        self.manager = OffloadManager(self.cpu.num_slots, eviction_policy)
        self.storage = storage
        self._ids = itertools.count(1)
        self._cpu_jobs: dict[int, tuple[str, object]] = {}  # cpu job -> (kind, state)
        self._storage_jobs: dict[int, tuple[str, object]] = {}
        self._done: list[TieredResult] = []

    @classmethod
    def from_config(cls, canonical: CanonicalKVCaches, config: OffloadConfig,
                    fingerprint: str) -> TieredStore:
        from kv_offload.backends import make_storage_tier

        storage = make_storage_tier(config, fingerprint)  # fs_root_dir or storage_tier
        return cls(canonical, config.cpu_bytes_to_use, storage=storage,
                   eviction_policy=config.eviction_policy)

    def lookup(self, keys: Sequence[OffloadKey]) -> list[Location]:
        """Where each key can be loaded from (never touches the disk)."""
        on_host = [self.manager.is_ready(k) for k in keys]
        missing = [k for k, hit in zip(keys, on_host) if not hit]
        stored = iter(self.storage.lookup([storage_key(k) for k in missing])
                      if self.storage and missing else [])
        return [Location.HOST if hit else (Location.STORAGE if next(stored, False)
                                           else Location.ABSENT) for hit in on_host]

    def storage_keys(self) -> list[tuple[bytes, int]] | None:
        """Every key the storage tier holds, or None (no storage tier, or one that cannot
        list its keys)."""
        keys = self.storage.keys() if self.storage is not None else None
        return None if keys is None else [offload_key(k) for k in keys]

    def submit_store(self, requests: Requests) -> int:
        """Copy engine blocks into host slots (then write through). Keys already held
        are skipped; when no room can be made the store is skipped (success=False)."""
        job_id = next(self._ids)
        targets = _targets(requests)
        plan = self.manager.prepare_store(list(targets))
        if plan is None:
            self._done.append(TieredResult(job_id, "store", False, _blocks_of(targets),
                                           no_room=True))
            return job_id
        if not plan.keys:
            self._done.append(TieredResult(job_id, "store", True))
            return job_id
        # A key listed twice is stored once, from its first block.
        firsts = {k: targets[k][:1] for k in plan.keys}
        cpu_job = self.cpu.submit_store(_transfers(plan.keys, plan.slots, firsts))
        self._cpu_jobs[cpu_job] = ("store", (job_id, plan.keys, targets))
        return job_id

    def submit_load(self, requests: Requests) -> int:
        """Fill engine blocks from host slots, reading storage-only keys into slots first."""
        load = _Load(next(self._ids), _targets(requests))
        keys = list(load.targets)
        where = self.lookup(keys)
        on_host = [k for k, w in zip(keys, where) if w is Location.HOST]
        in_storage = [k for k, w in zip(keys, where) if w is Location.STORAGE]
        load.failed = [k for k, w in zip(keys, where) if w is Location.ABSENT]
        self.manager.prepare_load(on_host)
        load.pinned = on_host
        self.manager.touch(on_host)
        plan = self.manager.prepare_store(in_storage) if in_storage else None
        if plan is None or not plan.keys:
            load.failed += in_storage  # no room for them (or raced): recompute
            self._load_from_host(load)
            return load.job_id
        load.failed += list(plan.already_present)
        buffers = [self.cpu.slot_buffer(slot, key[1]) for key, slot in zip(plan.keys, plan.slots)]
        read = self.storage.submit_read([storage_key(k) for k in plan.keys], buffers)
        self._storage_jobs[read] = ("read", (load, plan.keys))
        return load.job_id

    def poll(self) -> list[TieredResult]:
        """Advance every job; return the results finished since the last call."""
        for result in self.cpu.poll():
            kind, state = self._cpu_jobs.pop(result.job_id)
            if kind == "store":
                self._store_copied(state, result.success)
            else:
                self._load_copied(state, result.success)
        if self.storage is not None:
            for result in self.storage.poll():
                kind, state = self._storage_jobs.pop(result.job_id)
                if kind == "read":
                    self._read_done(state, result.succeeded)
                else:
                    self.manager.complete_load(list(state))  # written through: unpin
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: Sequence[int], timeout: float = 60.0) -> list[TieredResult]:
        """Poll until these jobs finished; their results, in order (others stay queued)."""
        wanted, found = set(job_ids), {}
        deadline = time.monotonic() + timeout
        while wanted - found.keys():
            for result in self.poll():
                if result.job_id in wanted:
                    found[result.job_id] = result
                else:
                    self._done.append(result)  # someone else's: keep it for their poll
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs {sorted(wanted - found.keys())} did not finish "
                                   f"within {timeout} s")
            time.sleep(0.0005)
        return [found[j] for j in job_ids]

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every write-through has finished (e.g. before shutdown)."""
        deadline = time.monotonic() + timeout
        while self._storage_jobs or self._cpu_jobs:
            finished = self.poll()  # (poll swaps self._done: read it only afterwards)
            self._done.extend(finished)
            if time.monotonic() > deadline:
                raise TimeoutError("write-through did not finish in time")
            time.sleep(0.001)

    def reset(self, *, storage_too: bool = False) -> None:
        """Forget everything in host memory (loads in progress finish with the old bytes).
        `storage_too` also waits for pending write-throughs and then empties the storage
        tier, if it can be emptied (`clear`): e.g. after new weights, nothing may be served."""
        if storage_too and self.storage is not None:
            self.flush()
        self.manager.reset()
        if storage_too and self.storage is not None:
            self.storage.clear()

    def close(self) -> None:
        self.cpu.close()
        if self.storage is not None:
            self.storage.close()

    def _store_copied(self, state, success: bool) -> None:
        job_id, keys, targets = state
        self.manager.complete_store(list(keys), success)
        failed = {} if success else _blocks_of({k: targets[k] for k in keys})
        self._done.append(TieredResult(job_id, "store", success, failed))
        if success and self.storage is not None:
            present = self.storage.lookup([storage_key(k) for k in keys])
            todo = [k for k, held in zip(keys, present)
                    if not held and self.manager.is_ready(k)]  # (a reset may have dropped it)
            if todo:  # pin the slots until their bytes are on disk
                slots = self.manager.prepare_load(todo)
                buffers = [self.cpu.slot_buffer(s, k[1]) for k, s in zip(todo, slots)]
                write = self.storage.submit_write([storage_key(k) for k in todo], buffers)
                self._storage_jobs[write] = ("write", todo)

    def _read_done(self, state, succeeded) -> None:
        load, keys = state
        ok = [k for k, good in zip(keys, succeeded) if good]
        bad = [k for k, good in zip(keys, succeeded) if not good]
        self.manager.complete_store(bad, False)
        self.manager.complete_store(ok, True)
        lost = [k for k in ok if not self.manager.is_ready(k)]  # a reset dropped them mid-read
        ok = [k for k in ok if self.manager.is_ready(k)]
        bad += lost
        self.manager.prepare_load(ok)
        load.pinned += ok
        load.from_storage = len(ok)
        load.failed += bad
        self._load_from_host(load)

    def _load_from_host(self, load: _Load) -> None:
        if not load.pinned:
            self._load_copied(load, True)
            return
        slots = [self.manager.slot_of(k) for k in load.pinned]
        cpu_job = self.cpu.submit_load(_transfers(load.pinned, slots, load.targets))
        self._cpu_jobs[cpu_job] = ("load", load)

    def _load_copied(self, load: _Load, success: bool) -> None:
        self.manager.complete_load(load.pinned)
        failed_keys = load.failed + ([] if success else load.pinned)
        failed = _blocks_of({k: load.targets[k] for k in failed_keys})
        self._done.append(TieredResult(load.job_id, "load", not failed, failed,
                                       load.from_storage))


def _targets(requests: Requests) -> dict[OffloadKey, list[int]]:
    targets: dict[OffloadKey, list[int]] = {}
    for group, (hashes, block_ids) in requests.items():
        if len(hashes) != len(block_ids):
            raise ValueError(f"group {group}: {len(hashes)} hashes but {len(block_ids)} blocks")
        for block_hash, block in zip(hashes, block_ids):
            targets.setdefault((block_hash, group), []).append(int(block))
    return targets


def _transfers(keys, slots, targets) -> dict[int, tuple[list[int], list[int]]]:
    """CpuBackend transfers: every target block of each key paired with its slot."""
    out: dict[int, tuple[list[int], list[int]]] = {}
    for key, slot in zip(keys, slots):
        blocks, slot_ids = out.setdefault(key[1], ([], []))
        for block in targets[key]:
            blocks.append(block)
            slot_ids.append(slot)
    return out


def _blocks_of(targets: Mapping[OffloadKey, list[int]]) -> dict[int, list[int]]:
    failed: dict[int, list[int]] = {}
    for (_, group), blocks in targets.items():
        failed.setdefault(group, []).extend(blocks)
    return {g: sorted(b) for g, b in failed.items()}
