"""`TieredStore`'s records: the results it hands out, and its jobs in flight; and the
request <-> transfer helpers.

One record per piece of work that waits for another thread: a store's host copy, a load
(its host copies and storage reads, staged), a storage read, a write-through. Typed
records, so the code that completes a piece reads its fields by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kv_offload.backends.base import TierStats
from kv_offload.types import Direction, GroupBlocks, OffloadKey


@dataclass(frozen=True)
class TieredResult:
    """The outcome of one store or load. `failed` maps group -> engine block ids whose
    bytes did not arrive (load: recompute them; store: they were not offloaded)."""

    job_id: int
    direction: Direction
    success: bool
    failed: dict[int, list[int]] = field(default_factory=dict)
    from_storage: int = 0  # load: keys read from the storage tier (the rest came from host)
    skipped: int = 0  # store: keys not stored, the host tier had no room for them


@dataclass(frozen=True)
class TierUsage:
    """Bytes in use and budgeted, per tier (for gauges)."""

    host_bytes_used: int
    host_bytes_total: int
    storage: TierStats


@dataclass(frozen=True)
class StorageWrites:
    """Bytes the storage tier stored over an interval: the pages, and the records it wrote
    for them (headers included; smaller with ``compression``)."""

    page_bytes: int
    record_bytes: int


@dataclass
class Store:
    """A store: its engine blocks are copied into host slots a piece at a time, as host
    room allows (`waiting` first); each piece is written through once copied."""

    job_id: int
    targets: dict[OffloadKey, list[int]]  # key -> engine block ids
    started: float
    waiting: list[OffloadKey] = field(default_factory=list)  # keys not copied yet
    pending: int = 0  # pieces being copied
    failed: list[OffloadKey] = field(default_factory=list)  # copies that failed
    skipped: list[OffloadKey] = field(default_factory=list)  # no host room for them
    abandoned: bool = False  # the engine may have overwritten the blocks mid-copy
    ready: Any = None  # GPU: the engine-stream event its copies out of the engine wait for
    layers: Any = None  # LayerSteps: every piece copies layer i once the forward released it


@dataclass
class StorePiece:
    """Keys of a store being copied into host slots."""

    store: Store
    keys: tuple[OffloadKey, ...]


@dataclass
class LoadPiece:
    """Keys of a load being copied from host slots into the engine."""

    load: Load
    keys: list[OffloadKey]


@dataclass
class Load:
    """A load: host keys copied at once, storage keys read in batches (`waiting` first)."""

    job_id: int
    targets: dict[OffloadKey, list[int]]  # key -> engine block ids
    started: float
    waiting: list[OffloadKey] = field(default_factory=list)  # storage keys not read yet
    # Keys another job is bringing into host slots (a concurrent load's read of the same
    # prefix): copied into the engine once they land there, not read twice.
    awaiting: list[OffloadKey] = field(default_factory=list)
    reads: list[Read] = field(default_factory=list)  # storage reads in flight
    failed: list[OffloadKey] = field(default_factory=list)
    pending: int = 0  # host copies and reads in flight
    from_storage: int = 0
    closed: bool = False  # failed whole: pieces still in flight only release resources
    ready: Any = None  # GPU: the engine-stream event its copies into the engine wait for
    layers: Any = None  # LayerSteps: the progress of a load copied in one piece, per layer
    inline: bool = False  # host copies on the polling thread (an in-step load: CPU engines)
    # (manager.settled, stores ended) when `awaiting` was last checked: re-checked once
    # either moved (or at the deadline), not at every poll
    seen: tuple[int, int] = (-1, -1)


@dataclass
class Read:
    """Storage keys of a load being read into host slots."""

    load: Load
    keys: tuple[OffloadKey, ...]
    generation: bytes
    started: float
    given_up: bool = False  # past its deadline: the load went on without it


@dataclass
class WriteThrough:
    """Host slots (pinned) being written to the storage tier."""

    keys: tuple[OffloadKey, ...]
    generation: bytes


@dataclass
class Probe:
    """Storage keys read into free host slots to measure the storage tier before any load
    needs it (`kv_offload.store.probe`); no load waits for them."""

    keys: tuple[OffloadKey, ...]
    generation: bytes
    started: float


StorageJob = Read | WriteThrough | Probe  # what a storage tier's job id stands for
HostCopy = StorePiece | LoadPiece  # what a host copy's job id stands for


def targets_of(requests: GroupBlocks) -> dict[OffloadKey, list[int]]:
    """key -> engine block ids, from `{group: (hashes, block ids)}`."""
    targets: dict[OffloadKey, list[int]] = {}
    for group, (hashes, block_ids) in requests.items():
        if len(hashes) != len(block_ids):
            raise ValueError(f"group {group}: {len(hashes)} hashes but {len(block_ids)} blocks")
        for block_hash, block in zip(hashes, block_ids):
            targets.setdefault((block_hash, group), []).append(int(block))
    return targets


def transfers(keys, slots, targets) -> dict[int, tuple[list[int], list[int]]]:
    """HostTier transfers: every target block of each key paired with its slot."""
    out: dict[int, tuple[list[int], list[int]]] = {}
    for key, slot in zip(keys, slots):
        blocks, slot_ids = out.setdefault(key[1], ([], []))
        for block in targets[key]:
            blocks.append(block)
            slot_ids.append(slot)
    return out


def blocks_of(targets: Mapping[OffloadKey, list[int]]) -> dict[int, list[int]]:
    """group -> sorted engine block ids of these keys."""
    failed: dict[int, list[int]] = {}
    for (_, group), blocks in targets.items():
        failed.setdefault(group, []).extend(blocks)
    return {g: sorted(b) for g, b in failed.items()}
