"""TieredStore: the host-memory tier in front of an optional storage tier (disk, servers).

Stores land in host slots (HostTier) and are then written through to the storage tier
in the background; host eviction therefore loses nothing the storage tier holds. A key
found only in the storage tier is read into a host slot, then copied into the engine like
a host hit. A load larger than the host tier is staged: its storage keys are read in
batches of at most `staging_slots`, each batch copied into the engine and released before
the next, so the storage tier's capacity, not the host tier's, bounds what can be served.
A store larger than the host room is staged the same way (`store.stores`): copied a piece
at a time as write-throughs of earlier pieces free host slots, so it reaches the storage
tier whole.

Every job ends with exactly one `TieredResult` that names the engine blocks whose bytes
did not arrive; the engine recomputes those and nothing else is affected. Exactly once,
whatever order failures arrive in: a job id is delivered only while it is open
(`JobBook.finish`), so a late piece of a job that already failed is absorbed, never re-reported.
Nothing here raises into the caller after construction: a fault in the bookkeeping of
one job (a plug-in eviction policy, a tier that raises on submit or poll) fails that job,
is counted in `faults`, and is logged once per episode.

What the tiers hold is tracked in a `KeyView` (host events, the storage tier's change
feed, our write-throughs and failed reads); `take_changes` drains it in bounded batches.
Driven from one thread at a time (the connector's worker lock): submit jobs, then `poll`
(`busy`: whether it has anything to advance; the pump reads it without the lock).

The store is composed of parts that own their state (`kv_offload.store.shared`): the load
pipeline (`loads`), the store pipeline (`stores`) and the read probe (`probe`), over the
tiers and the job book they share. The store routes each finished host copy or storage job
to the part it belongs to, and contains every fault of a part.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from kv_offload.backends.base import StorageTier, TierStats
from kv_offload.backends.record import CHECKSUM, RecordCodec
from kv_offload.canonical import CanonicalKVCaches
from kv_offload.config import OffloadConfig, format_size
from kv_offload.errors import ConfigError
from kv_offload.kernels.runtime import EngineReady
from kv_offload.runtime.faults import FaultLog
from kv_offload.store.generations import read_stored_generation, write_stored_generation
from kv_offload.store.host import HostTier
from kv_offload.store.host.layer_copies import LayerSteps
from kv_offload.store.jobs import (
    HostCopy,
    LoadPiece,
    Probe,
    Read,
    StorageJob,
    StorageWrites,
    StorePiece,
    TieredResult,
    TierUsage,
)
from kv_offload.store.key_view import KeyView, new_generation, offload_key
from kv_offload.store.loads import LoadPipeline
from kv_offload.store.manager import OffloadManager, SlotState
from kv_offload.store.probe import ReadProbe, probe_bytes_for
from kv_offload.store.read_rate import ReadRate
from kv_offload.store.shared import JobBook, Tiers
from kv_offload.store.stores import StorePipeline
from kv_offload.store.tp.records import RankRecords
from kv_offload.types import Direction, GroupBlocks, KeyChanges, Location, OffloadKey

logger = logging.getLogger("kv_offload")


@dataclass(frozen=True)
class FleetGeneration:
    """The key generation a storage tier keeps, and the keys it holds in it."""

    generation: bytes
    keys: list[OffloadKey]

ABSORB_PER_POLL = 1024  # storage-tier changes taken per poll (bounds the work under the lock)
PROTECT_PENDING_SLOTS = 4  # keys protected before they land, remembered: x the host slots
FILE_FORMAT_VERSION = 2  # bump when stored bytes or keys change meaning (joins the fingerprint)


def layout_fingerprint(canonical: CanonicalKVCaches, extra: str = "") -> str:
    """A stable name for the page layout (plus e.g. model, TP size and rank in `extra`):
    bytes stored under one fingerprint are never served to another. The file-format version
    and every group's ordered layer names are in it: permuted pages never pass as valid."""
    layers = [[ref.layer_name for ref in refs] for refs in canonical.group_refs]
    return xxhash.xxh3_64_hexdigest(
        repr((FILE_FORMAT_VERSION, canonical.layout_signature(), layers, extra)).encode())


class TieredStore:
    """Host slots (with their manager) in front of an optional `StorageTier`."""

    def __init__(self, canonical: CanonicalKVCaches, cpu_bytes_to_use: int, *,
                 storage: StorageTier | None = None, eviction_policy: str = "slru",
                 pin: bool | None = None, read_timeout_s: float = 30.0,
                 staging_slots: int | None = None, store_stage_timeout_s: float = 1.0,
                 report_storage_copies: bool = False, codec: RecordCodec = CHECKSUM,
                 fingerprint: str = "", probe_bytes: int = 0,
                 copy_timeout_s: float = 30.0) -> None:
        cpu = HostTier(canonical, cpu_bytes_to_use, pin=pin, copy_timeout_s=copy_timeout_s)
        self.tiers = tiers = Tiers(cpu, OffloadManager(cpu.num_slots, eviction_policy),
                                   storage, FaultLog("kv-offload tiers"),
                                   KeyView(report_storage_copies=report_storage_copies))
        self.eviction_policy = eviction_policy
        self.book = JobBook(cpu)
        self.stores = StorePipeline(tiers, self.book, stage_timeout_s=store_stage_timeout_s)
        self.loads = LoadPipeline(tiers, self.book, self.stores, read_timeout_s=read_timeout_s,
                                  staging_slots=staging_slots or max(1, cpu.num_slots // 4))
        self.probe = ReadProbe(tiers, self.book, self.loads, probe_bytes)  # (0: no probe)
        # The storage key generation: the one the storage tier keeps (a reset before a
        # restart stays in force; see kv_offload.store.generations). `codec` and `fingerprint`
        # seal that record as the tier's own records are sealed.
        self._codec, self._fingerprint = codec, fingerprint
        # Whether the tier was unreachable at start: then the engine runs in a fresh
        # generation of its own and joins the fleet's once the tier answers.
        self.generation_unsettled = False
        if storage is not None:
            stored = read_stored_generation(storage, codec, fingerprint)
            # (unreadable or not verifiable: never pre-reset keys, start a new one)
            tiers.generation = stored.generation or new_generation()
            self.generation_unsettled = stored.unreachable
        self._rejected_seen = 0  # the storage tier's rejected_records, as last reported
        self._written_seen = (0, 0)  # its page_bytes_written and record_bytes_written

    # The tiers' parts, by the names callers and the metrics read them by (one source of
    # truth: the parts read `Tiers`, so a storage tier plugged in here reaches them too).
    @property
    def cpu(self) -> HostTier:
        return self.tiers.cpu

    @property
    def manager(self) -> OffloadManager:
        return self.tiers.manager

    @property
    def storage(self) -> StorageTier | None:
        return self.tiers.storage

    @storage.setter
    def storage(self, tier: StorageTier | None) -> None:
        """Plug a storage tier into a store that has none yet (tools, benchmarks): under
        the caller's lock, before any job."""
        self.tiers.storage = tier

    @property
    def view(self) -> KeyView:
        return self.tiers.view

    @property
    def faults(self) -> FaultLog:
        return self.tiers.faults

    @property
    def read_rate(self) -> ReadRate:
        """The storage tier's measured read throughput (loads' reads and the probe's)."""
        return self.tiers.read_rate

    @property
    def generation(self) -> bytes:
        """The storage key generation in force."""
        return self.tiers.generation

    @property
    def read_timeout_s(self) -> float:
        return self.loads.read_timeout_s

    @property
    def probe_bytes(self) -> int:
        return self.probe.probe_bytes

    @classmethod
    def from_config(cls, canonical: CanonicalKVCaches, config: OffloadConfig,
                    fingerprint: str, *, records: RankRecords | None = None,
                    report_storage_copies: bool = False) -> TieredStore:
        """`records`: keep TP-free records in the storage tier, namespaced by their shared
        fingerprint (`tp.records`); None: this rank's pages under `fingerprint`."""
        from kv_offload.backends import make_storage_tier
        from kv_offload.backends.common.sealing import make_codec
        from kv_offload.store.tp.tier import TPRecordTier

        codec = make_codec(config.secret_file, config.encrypt, config.compression)
        if records is not None:
            fingerprint = records.fingerprint
        storage = make_storage_tier(config, fingerprint, codec)  # (storage_tier, or fs_*)
        if storage is not None and records is not None:
            storage = TPRecordTier(storage, records)
        store = cls(canonical, config.cpu_bytes_to_use, storage=storage, codec=codec,
                    eviction_policy=config.eviction_policy, fingerprint=fingerprint,
                    report_storage_copies=report_storage_copies,
                    probe_bytes=probe_bytes_for(config, len(canonical.group_refs)),
                    copy_timeout_s=config.copy_timeout_s)
        if config.storage_required and store.generation_unsettled:
            store.close()  # (start-up: the engine stops with the error)
            raise ConfigError(
                f"storage_required is set and storage_tier {config.storage_tier!r} "
                f"({storage.describe()}) cannot be reached at start-up; start it, fix its "
                f"address, or unset storage_required to start with host memory only until "
                f"it answers")
        return store

    # --- queries (memory only) ---

    def lookup(self, keys: Sequence[OffloadKey]) -> list[Location]:
        """Where each key can be loaded from (never touches the storage tier)."""
        return self.tiers.lookup(keys)

    def read_fleet_generation(self) -> FleetGeneration | None:
        """Bounded I/O and the tier's key listing, without the caller's lock: the
        generation the storage tier keeps now (this engine's own, stored, if it keeps
        none) and the keys the tier holds in it, or None while it is still unreachable.
        For `settle_generation`."""
        storage = self.storage
        if storage is None:
            return None
        stored = read_stored_generation(storage, self._codec, self._fingerprint,
                                        fresh=self.tiers.generation, quiet=True)
        if stored.unreachable:
            return None
        generation = stored.generation or self.tiers.generation  # (a bad record: ours)
        if generation == self.tiers.generation:
            return FleetGeneration(generation, [])
        names = self._guarded("storage keys", storage.keys, None) or ()
        return FleetGeneration(generation, [k for k in (offload_key(n, generation)
                                                        for n in names) if k is not None])

    def settle_generation(self, fleet: FleetGeneration) -> None:
        """Caller's lock: adopt the fleet's key generation, found once the storage tier
        answered (this engine started while it could not be reached): what the tier holds
        in it becomes servable, keys stored under the engine's interim one are forgotten
        (they age out), host memory stays. O(keys in it), once."""
        self.generation_unsettled = False
        if fleet.generation == self.tiers.generation or self.storage is None:
            return
        self.tiers.generation = fleet.generation
        self.view.replace_storage(fleet.keys)
        logger.warning("kv-offload: the storage tier answers again; joined the key "
                       "generation the engines sharing it use (what this engine stored "
                       "while it could not see it is dropped)")

    def keys_to_find(self, keys: Sequence[OffloadKey]) -> list[bytes]:
        """The storage tier's names of those of `keys` it is not known to hold (nor host
        memory): what `find_in_storage` should ask it about. From memory only."""
        if self.storage is None:
            return []
        unknown = [k for k, where in zip(keys, self.tiers.lookup(keys), strict=True)
                   if where is Location.ABSENT]
        return self.tiers.storage_keys(unknown)

    def find_in_storage(self, names: Sequence[bytes]) -> None:
        """Ask the storage tier itself whether it holds `names` now (another engine may
        have just stored them: `StorageTier.find`); those it holds reach `take_changes` as
        keys its refresh finds do. Bounded I/O, off the step path (the worker's finder
        thread); a fault is the caller's to contain."""
        storage = self.storage
        if storage is not None and names:
            storage.find(names)

    def take_changes(self, max_keys: int) -> KeyChanges:
        """Keys whose location changed since the last call, at most `max_keys` (O(changes))."""
        self._absorb_host_events()
        return self.view.take(max_keys)

    def usage(self) -> TierUsage:
        """Host slots in use (O(1)) and the storage tier's own statistics."""
        cpu = self.cpu
        used = (cpu.num_slots - self.manager.num_free_slots) * cpu.slot_bytes
        storage = self._guarded("storage stats", self.storage.stats, TierStats()) \
            if self.storage is not None else TierStats()
        return TierUsage(used, cpu.num_slots * cpu.slot_bytes, storage)

    def describe(self) -> str:
        """What this store set up, in one line for the start-up log (never a secret)."""
        cpu = self.cpu
        host = f"host tier {format_size(cpu.num_slots * cpu.slot_bytes)} ({cpu.num_slots} " \
               f"slots of {format_size(cpu.slot_bytes)}, eviction {self.eviction_policy})"
        storage = self.storage.describe() if self.storage is not None else "none"
        codec = self._codec
        trust = ("records encrypted and authenticated (secret_file, " if codec.encrypts else
                 "records authenticated (secret_file, " if codec.keyed else
                 "records unauthenticated (no secret_file: every writer of the store is "
                 "trusted, ") + codec.algo + ")"
        if codec.compression is not None:
            trust += f", compressed ({codec.compression.name})"
        return f"{host}; storage tier: {storage}; {trust}"

    def take_fault_counts(self) -> dict[str, int]:
        """Faults contained since the last call, by where they happened (for metrics)."""
        return self.faults.take_counts()

    def engine_ready(self) -> EngineReady:
        """The point in the engine's work a copy must wait for, recorded on the calling
        thread's current stream (GPU); pass it to `submit_store` / `submit_load`."""
        return self.cpu.engine_ready()

    def take_rejected(self, usage: TierUsage) -> int:
        """Stored records the storage tier refused (bad checksum or tag) since the last call,
        from a `usage()` snapshot (the tier counts them since it started)."""
        total = usage.storage["rejected_records"]
        new, self._rejected_seen = max(0, total - self._rejected_seen), total
        return new

    def take_written(self, usage: TierUsage) -> StorageWrites:
        """What the storage tier stored since the last call, from a `usage()` snapshot (the
        tier counts it since it started)."""
        counts = usage.storage.counts
        totals = (counts.get("page_bytes_written", 0), counts.get("record_bytes_written", 0))
        seen, self._written_seen = self._written_seen, totals
        return StorageWrites(max(0, totals[0] - seen[0]), max(0, totals[1] - seen[1]))

    def take_key_failures(self) -> dict[Direction, int]:
        """Storage keys whose read or write failed since the last call (for metrics)."""
        failures = dict(self.tiers.key_failures)
        self.tiers.key_failures = Counter()
        return failures

    # --- hits ---

    def protect(self, keys: Sequence[OffloadKey]) -> None:
        """Keys of hits the scheduler's lookups found, or of a prefix several requests
        asked for (in order: the last is the most valuable, a prefix's first block): every
        tier keeps them before keys stored once and never asked for
        (`EvictionPolicy.touched`, `StorageTier.touch`). A key not yet in a tier (its store
        still in flight, or not yet submitted) is protected there when it lands, if it
        lands before `PROTECT_PENDING_SLOTS` x the host slots of later such keys. Memory
        only, O(keys); a fault costs hit rate, never the step."""
        try:
            manager = self.manager
            manager.touch(keys)  # (a key in a host slot but not ready: once it is)
            in_storage = self.view.in_storage if self.storage is not None else None
            absent = [k for k, state in zip(keys, manager.lookup(keys))
                      if state is SlotState.ABSENT and not (in_storage and in_storage(k))]
            limit = PROTECT_PENDING_SLOTS * self.cpu.num_slots
            unwritten = [k for k in keys if not in_storage(k)] if in_storage else []
            self.stores.protect_later(absent, unwritten, limit)
            stored = [k for k in keys if in_storage(k)] if in_storage else []
            if stored:
                self.storage.touch(self.tiers.storage_keys(stored))
        except Exception as exc:
            self.faults.failed("hit protection", exc)

    # --- jobs ---

    def submit_store(self, requests: GroupBlocks, ready: EngineReady | None = None,
                     layers: LayerSteps | None = None) -> int:
        """Copy engine blocks into host slots (then write through). Keys already held are
        skipped. A store larger than the host room is staged (`store.stores`): the job
        ends once every key is in a slot; keys that cannot get room are `skipped`. On a
        GPU every piece's copy waits for `ready` (an event on the engine's stream after the
        forward that wrote the blocks; `HostTier.engine_ready()`), also pieces submitted
        later from the pump, so the CPU never waits for the forward. `layers`: submitted
        before the forward ended, every piece copies layer i once its gate opened."""
        # Staged at the next `poll` (the pump's thread), not in the caller's: this call
        # is on the engine's step path and costs O(blocks) of bookkeeping only.
        return self.stores.submit(requests, ready, layers)

    def submit_load(self, requests: GroupBlocks, ready: EngineReady | None = None,
                    layers: LayerSteps | None = None, inline: bool = False) -> int:
        """Fill engine blocks from host slots, reading storage-only keys into slots first.
        On a GPU every copy into the engine waits for `ready` (recorded on the engine's
        stream when the load was planned: it orders them after vLLM's own work on those
        blocks, even for pieces submitted later from another thread). `layers`: a load
        copied in one piece (all its keys in host memory) marks its layers copied in order
        there, one in several pieces none. `inline`: an in-step load (`HostTier.submit`)."""
        # Planned at the next `poll` (the pump's thread), first thing, so its host keys are
        # pinned before that poll stages any store: this call is on the engine's step path.
        return self.loads.submit(requests, ready, layers, inline)

    def abandon_load(self, job_id: int) -> None:
        """The caller stopped waiting for this load (`LoadPipeline.abandon`)."""
        self.loads.abandon(job_id)

    def abandon_store(self, job_id: int) -> None:
        """The engine may overwrite this store's blocks (`StorePipeline.abandon`)."""
        self.stores.abandon(job_id)

    def busy(self) -> bool:
        return self.book.in_flight or self.loads.busy or self.stores.busy

    def poll(self) -> list[TieredResult]:
        """Advance every job; return the results finished since the last call. Never raises."""
        book = self.book
        self._guarded("load planning", self.loads.plan_new, None)
        for result in self._guarded("host copy results", self.cpu.poll, []):
            piece = book.cpu_jobs.pop(result.job_id, None)
            if piece is not None:
                self._guarded("host copy bookkeeping", lambda r=piece, s=result.success:
                              self._host_copied(r, s), None, fail=piece)
        if self.storage is not None:
            for result in self._guarded("storage poll", self.storage.poll, []):
                job = book.storage_jobs.pop(result.job_id, None)
                if job is not None:
                    self._guarded("storage results", lambda j=result.job_id, r=job,
                                  t=result: self._storage_done(j, r, t.succeeded), None,
                                  fail=job)
        self._guarded("staging", self.loads.advance, None)
        self._guarded("store staging", self.stores.advance, None)
        self.cpu.slots_in_use_below(self.manager.high_water)  # (host pages ahead of use)
        self._guarded("storage change feed", self._absorb_storage_changes, None)
        self._guarded("read probe", self.probe.step, None)
        return book.take_done()

    def wait(self, job_ids: Sequence[int], timeout: float = 60.0) -> list[TieredResult]:
        """Poll until these jobs finished; their results, in order (others stay queued for
        `poll`). For callers that can block (tools, tests); raises TimeoutError."""
        wanted, found, deadline = set(job_ids), {}, time.monotonic() + timeout
        while wanted - found.keys():
            for result in self.poll():
                if result.job_id in wanted:
                    found[result.job_id] = result
                else:
                    self.book.done.append(result)  # someone else's: keep it for their poll
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs {sorted(wanted - found.keys())} did not finish "
                                   f"within {timeout} s")
            time.sleep(0.0005)
        return [found[j] for j in job_ids]

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every job, write-throughs included, has finished (e.g. before
        shutdown); their results stay queued for `poll`. False on timeout."""
        deadline = time.monotonic() + timeout
        while self.busy():
            finished = self.poll()  # (poll swaps the book's results: read them afterwards)
            self.book.done.extend(finished)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def reset(self) -> None:
        """Forget everything: host slots at once (loads in progress finish with the old
        bytes), storage keys by starting a new generation (no file is deleted: other engines
        may share the storage; old keys age out under its budget). The new generation is
        written to the storage tier (one small write, bounded by its timeouts), so a
        restart starts in it too."""
        self.manager.reset()
        self.manager.take_events()
        self.stores.forget_protected()
        self.tiers.generation = generation = new_generation()
        self.view.reset()
        if self.storage is not None:  # (rare, bounded by the tier's timeouts)
            self._guarded("key generation", lambda: write_stored_generation(
                self.storage, generation, self._codec, self._fingerprint), None)

    def close(self) -> None:
        self.cpu.close()
        if self.storage is not None:
            self.storage.close()

    # --- internals: plumbing ---

    def _host_copied(self, piece: HostCopy, success: bool) -> None:
        if isinstance(piece, StorePiece):
            self.stores.piece_copied(piece, success)
        else:
            self.loads.piece_copied(piece, success)

    def _storage_done(self, job: int, record: StorageJob, succeeded: Sequence[bool]) -> None:
        if isinstance(record, Read):
            self.loads.read_done(job, record, succeeded)
        elif isinstance(record, Probe):
            self.probe.done(record, succeeded)
        else:
            self.stores.write_done(record, succeeded)

    def _absorb_host_events(self) -> None:
        for event in self.manager.take_events():
            (self.view.host_added if event.kind == "stored" else
             self.view.host_removed)(event.keys)

    def absorb_storage_changes(self) -> None:
        """Take a bounded batch of the storage tier's changes into the view now (keys a
        `find_in_storage` just adopted), as every `poll` does."""
        self._absorb_storage_changes()

    def _absorb_storage_changes(self) -> None:
        """Take a bounded batch of the storage tier's change feed into the view (each
        poll: a start-up inventory of a million keys streams in over a few seconds
        without holding the caller's lock for long)."""
        if self.storage is None:
            return
        changes = self.storage.take_changes(ABSORB_PER_POLL)
        generation = self.tiers.generation
        added = (offload_key(k, generation) for k in changes.added)
        removed = (offload_key(k, generation) for k in changes.removed)
        self.view.storage_added([k for k in added if k is not None])
        self.view.storage_removed([k for k in removed if k is not None])

    def _guarded(self, where: str, fn: Callable, default, *, fail=None):
        """Run one step of the pipeline; a fault is contained: counted, logged once per
        episode, and the job it belongs to (`fail`) ends as failed."""
        try:
            value = fn()
        except Exception as exc:
            self.faults.failed(where, exc)
            if fail is not None:
                self._fail_record(fail)
            return default
        self.faults.succeeded(where)
        return value

    def _fail_record(self, record: HostCopy | StorageJob) -> None:
        """A fault in a job's bookkeeping: the store or load it belongs to fails whole (a
        write-through or probe belongs to no job: it only counts as a fault)."""
        if isinstance(record, StorePiece):
            self.stores.fail(record.store)
        elif isinstance(record, Read | LoadPiece):
            self.loads.fail(record.load)
