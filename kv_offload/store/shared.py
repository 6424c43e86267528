"""What the parts of `TieredStore` share: the tiers they drive and the book of jobs in flight.

`TieredStore` is composed of three parts, each owning its own state: the load pipeline
(`store.loads`), the store pipeline (`store.stores`) and the read probe (`store.probe`).
They drive the same tiers and hand their results out through the same book, so those two
are objects of their own, made once by the store and passed to every part:

- `Tiers`: the host tier and its slot manager, the storage tier (or None), the view of what
  both hold, the current storage-key generation, the fault log and the per-direction key
  failures and read rate that the metrics take. The store's parts read and update them; the
  store itself only reads them for its queries.
- `JobBook`: job ids, the jobs in flight by the thread that completes them (host copies,
  storage jobs) and the results not yet handed out. A result is delivered once: only while
  its job is open (`finish`), so a late piece of a job that already failed is absorbed.

Everything here is driven from one thread at a time (the connector's worker lock).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

from kv_offload.backends.base import StorageTier
from kv_offload.kernels.runtime import EngineReady
from kv_offload.runtime.faults import FaultLog
from kv_offload.store.host import HostTier
from kv_offload.store.host.layer_copies import LayerSteps
from kv_offload.store.jobs import HostCopy, StorageJob, StorePiece, TieredResult
from kv_offload.store.key_view import FIRST_GENERATION, KeyView, storage_key
from kv_offload.store.manager import OffloadManager
from kv_offload.store.read_rate import ReadRate
from kv_offload.types import Direction, Location, OffloadKey


class Tiers:
    """The host tier (its slots and their manager) and the optional storage tier, with the
    view of the keys they hold and what the metrics take from them."""

    def __init__(self, cpu: HostTier, manager: OffloadManager, storage: StorageTier | None,
                 faults: FaultLog, view: KeyView) -> None:
        self.cpu = cpu
        self.manager = manager
        self.storage = storage
        self.faults = faults
        self.view = view
        # The storage key generation in force (`kv_offload.store.generations`): a reset
        # starts a new one, so keys of the old one are never served again.
        self.generation: bytes = FIRST_GENERATION
        # Storage keys whose read (LOAD) or write (STORE) failed, for the metrics.
        self.key_failures: Counter[Direction] = Counter()
        self.read_rate = ReadRate()  # the storage tier's measured read throughput

    def lookup(self, keys: Sequence[OffloadKey]) -> list[Location]:
        """Where each key can be loaded from (memory only: never asks the storage tier)."""
        manager, view = self.manager, self.view
        return [Location.HOST if manager.is_ready(k) else
                Location.STORAGE if view.in_storage(k) else Location.ABSENT for k in keys]

    def storage_keys(self, keys: Sequence[OffloadKey]) -> list[bytes]:
        """The storage tier's names of `keys` in the generation in force."""
        generation = self.generation
        return [storage_key(k, generation) for k in keys]

    def read_into_slots(self, keys: Sequence[OffloadKey], slots: Sequence[int]) -> int:
        """Start reading `keys` from the storage tier into their host slots (the slots are
        the caller's, reserved); the tier's job id. Raises what the tier raises."""
        return self.storage.submit_read(self.storage_keys(keys), self._buffers(keys, slots))

    def write_from_slots(self, keys: Sequence[OffloadKey], slots: Sequence[int]) -> int:
        """Start writing `keys` from their (pinned) host slots to the storage tier; the
        tier's job id. Raises what the tier raises."""
        return self.storage.submit_write(self.storage_keys(keys), self._buffers(keys, slots))

    def _buffers(self, keys: Sequence[OffloadKey], slots: Sequence[int]) -> list:
        cpu = self.cpu
        return [cpu.slot_buffer(slot, key[1]) for key, slot in zip(keys, slots)]


class JobBook:
    """Job ids, jobs in flight (by what completes them) and results to hand out."""

    def __init__(self, cpu: HostTier) -> None:
        self._cpu = cpu
        self._ids = itertools.count(1)
        self._open: set[int] = set()  # jobs whose result is not delivered yet
        self.done: list[TieredResult] = []
        self.cpu_jobs: dict[int, HostCopy] = {}  # host copy job id -> what it copies
        self.storage_jobs: dict[int, StorageJob] = {}  # storage job id -> what it does

    def new_job(self) -> int:
        job_id = next(self._ids)
        self._open.add(job_id)
        return job_id

    def finish(self, result: TieredResult) -> None:
        """Deliver a job's result, once: a job already delivered is not delivered again."""
        if result.job_id in self._open:
            self._open.discard(result.job_id)
            self.done.append(result)

    def take_done(self) -> list[TieredResult]:
        done, self.done = self.done, []
        return done

    def submit_copy(self, record: HostCopy, direction: Direction, moves,
                    ready: EngineReady | None = None, layers: LayerSteps | None = None,
                    inline: bool = False) -> None:
        """Start a host copy (`HostTier.submit`) and remember what it is for."""
        self.cpu_jobs[self._cpu.submit(direction, moves, ready, layers, inline)] = record

    def copies_of(self, job: object) -> list[int]:
        """The host copies in flight that belong to this store or load. O(copies in
        flight): for the rare job given up on."""
        return [cpu_job for cpu_job, record in self.cpu_jobs.items()
                if (record.store if isinstance(record, StorePiece) else record.load) is job]

    @property
    def in_flight(self) -> bool:
        return bool(self.cpu_jobs or self.storage_jobs)
