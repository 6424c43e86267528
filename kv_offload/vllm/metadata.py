"""What the scheduler side tells the workers each step, and what the workers tell back.

Both cross process boundaries (vLLM pickles them), so they hold only plain data: block
hashes as bytes, block ids as ints. A report is two columns (keys, and a byte per key for
the media it is held in now), not one record per key: pickling 8192 `KeyChange` records
and loading them back took 11 ms, the columns 1.4 ms.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kv_offload.types import HOST_BIT, STORAGE_BIT, GroupBlocks, KeyChange, Location, OffloadKey


def held_bits(change: KeyChange) -> int:
    """The media bits of a change: what its key is held in once it applies."""
    if change.location is Location.HOST:
        return HOST_BIT | STORAGE_BIT if change.in_storage else HOST_BIT
    return STORAGE_BIT if change.location is Location.STORAGE else 0


@dataclass
class KVOffloadMetadata(KVConnectorMetadata):
    """One step's work for every worker rank."""

    loads: dict[str, GroupBlocks] = field(default_factory=dict)
    """Per request: blocks to fill from our tiers before the request runs."""
    in_step: list[str] = field(default_factory=list)
    """Those of `loads` that finish before this step's forward (the request runs in this
    step): their failures are reported as block ids, not in `failed_recving`."""
    failed_loads: list[str] = field(default_factory=list)
    """Requests promised a load that the scheduler could not plan: report them failed."""
    failed_blocks: list[int] = field(default_factory=list)
    """Blocks of in-step loads the scheduler could not plan: report them as load errors."""
    stores: GroupBlocks = field(default_factory=dict)
    """Blocks this step's forward completes, to copy out after it."""
    reset: bool = False
    """Drop everything held (vLLM's reset_prefix_cache(reset_connector=True))."""
    step: int = 0
    """Sequence number: workers echo how far their reports reflect these plans."""
    wait_for_stores: bool = True
    """Before this step's forward, wait until every store so far is copied out of engine
    memory: vLLM may reuse a block one of them reads (the scheduler sets it only then)."""
    idle: bool = False
    """No request runs a forward in this step (vLLM steps without one while requests wait
    for asynchronous loads): a worker with such a load in flight may wait, briefly, for it
    to land instead of returning at once (`OffloadWorker.finished_loads`)."""
    wait_for_loads: bool = False
    """Before this step's forward, wait until no in-step load given up on this rank still
    runs: vLLM hands a block one of them may still write to a request in this step (the
    blocks of a preempted request are freed at once; `OffloadWorker.wait_for_given_up_loads`)."""
    held: list[str] = field(default_factory=list)
    """Requests that finished while an in-step load of theirs may still be copying on some
    rank (given up at `copy_timeout_s`, or not yet reported): vLLM keeps their blocks until
    every rank reports each of them in `finished_recving`, which a rank does once no copy of
    that request's runs on it (`OffloadWorker.hold_for_copies`)."""

    protect: list[OffloadKey] = field(default_factory=list)
    """Keys of the hits lookups found since the last step, deepest first (the first block
    of a prefix last): each tier keeps them before keys stored once and never asked for
    (`TieredStore.protect`)."""
    find: list[OffloadKey] = field(default_factory=list)
    """Keys waiting requests need that no rank has reported: each rank asks its storage
    tier for them now (`TieredStore.find`, on the worker's own thread), in case another
    engine just stored them; what a tier holds comes back in the ranks' next reports."""

    def in_step_block_ids(self) -> set[int]:
        """Every engine block this step's in-step loads fill (planned or not): all of them
        are load errors when the worker cannot say which did not arrive."""
        return {i for r in self.in_step for _, ids in self.loads.get(r, {}).values()
                for i in ids} | set(self.failed_blocks)


@dataclass(frozen=True)
class RankReport:
    """What one worker rank tells the scheduler after a step."""

    keys: tuple[OffloadKey, ...]
    """Keys whose location (host / storage / absent) changed since the last report."""
    held: bytes
    """Per key, the media it is held in now: `HOST_BIT` | `STORAGE_BIT`, 0 for none."""
    reset: bool
    """Forget this rank's earlier reports first (its tiers were reset)."""
    reflected_step: int
    """The stores and resets of every step up to this one show in the changes."""
    read_bytes_per_s: float = 0.0
    """The rank's measured storage read throughput (`kv_offload.store.read_rate`; 0: none yet)."""
    stalled: tuple[str, ...] = ()
    """Requests whose in-step load this rank gave up at `copy_timeout_s` and which still
    runs (a stalled copy thread, a slow read): until it ends, another in-step load would
    wait for it too, and vLLM must not hand those requests' blocks to anyone else."""
    step: int = -1
    """The last plan step this rank started the loads of: its give-ups up to that step are
    in `stalled`."""
    found_through: int = -1
    """The last plan step whose `find` keys this rank asked its storage tier for: what the
    tier held shows in the changes reported so far."""
    identity: str = ""
    """What a stored record is keyed on beside its key (the weights, config and layout of
    the TP-free namespace, hashed): engines with the same identity read each other's
    records (prefill/decode: `kv_offload.vllm.pd_params`). Empty before `register`."""

    @property
    def copies_stalled(self) -> bool:
        """Whether a given-up in-step load of this rank still runs."""
        return bool(self.stalled)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.held):
            raise ValueError(f"a RankReport needs one held byte per key: {len(self.keys)} "
                             f"keys, {len(self.held)} bytes")

    @classmethod
    def of(cls, changes: Iterable[KeyChange], reset: bool, reflected_step: int,
           read_bytes_per_s: float = 0.0, stalled: tuple[str, ...] = (), step: int = -1
           ) -> RankReport:
        changes = tuple(changes)
        return cls(tuple(change.key for change in changes), bytes(map(held_bits, changes)),
                   reset, reflected_step, read_bytes_per_s, stalled, step)

    @property
    def changes(self) -> tuple[KeyChange, ...]:
        """The report as records (tests and tools; the scheduler reads the columns)."""
        return tuple(KeyChange(key, Location.HOST, bool(bits & STORAGE_BIT)) if bits & HOST_BIT
                     else KeyChange(key, Location.STORAGE if bits else Location.ABSENT)
                     for key, bits in zip(self.keys, self.held))


@dataclass
class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Per worker rank: its report. A rank with nothing new still reports, so the
    scheduler knows every rank is alive and how far its reports reflect the plans."""

    reports: dict[int, RankReport] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVOffloadWorkerMetadata:
        """Merge the reports of other ranks (or of the same rank, later in time)."""
        if not isinstance(other, KVOffloadWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into "
                            "KVOffloadWorkerMetadata")
        merged = dict(self.reports)
        for rank, later in other.reports.items():
            earlier = merged.get(rank)
            if earlier is not None and not later.reset:
                later = RankReport(earlier.keys + later.keys, earlier.held + later.held,
                                   earlier.reset,
                                   max(earlier.reflected_step, later.reflected_step),
                                   later.read_bytes_per_s or earlier.read_bytes_per_s,
                                   later.stalled, max(earlier.step, later.step),
                                   max(earlier.found_through, later.found_through),
                                   later.identity or earlier.identity)
            merged[rank] = later
        return KVOffloadWorkerMetadata(merged)
