"""What the scheduler side tells the workers each step, and what the workers tell back.

Both cross process boundaries (vLLM pickles them), so they hold only plain data: block
hashes as bytes, block ids as ints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

# {group: (block hashes, engine block ids)}: pair i moves block_ids[i] <-> hash i.
GroupBlocks = dict[int, tuple[list[bytes], list[int]]]
OffloadKey = tuple[bytes, int]  # (block hash, KV-cache group)


@dataclass
class KVOffloadMetadata(KVConnectorMetadata):
    """One step's work for every worker rank."""

    loads: dict[str, GroupBlocks] = field(default_factory=dict)
    """Per request: blocks to fill from our tiers before the request runs."""
    stores: GroupBlocks = field(default_factory=dict)
    """Blocks this step's forward completes, to copy out after it."""
    reset: bool = False
    """Drop everything held in host memory (vLLM's reset_prefix_cache(reset_connector=True))."""
    step: int = 0
    """Sequence number: workers echo how far their reports reflect these plans."""


# Where one rank holds a key: the scheduler counts holders per state.
ABSENT, ON_DISK, IN_HOST = 0, 1, 2
KeyChange = tuple[OffloadKey, int, int]  # (key, old state, new state)


@dataclass
class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Per worker rank: keys whose state (ABSENT / ON_DISK / IN_HOST) changed since the
    rank's last report. A rank with nothing new still reports (an empty list), so the
    scheduler knows every rank has sent its first inventory."""

    changes: dict[int, list[KeyChange]] = field(default_factory=dict)
    host_slots: dict[int, int] = field(default_factory=dict)
    """Per rank: blocks its host tier holds (a load must fit there, disk hits included)."""
    reflected_step: dict[int, int] = field(default_factory=dict)
    """Per rank: the stores and resets of every step up to this one show in its changes."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVOffloadWorkerMetadata:
        if not isinstance(other, KVOffloadWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into "
                            "KVOffloadWorkerMetadata")
        merged = dict(self.changes)
        for rank, changes in other.changes.items():
            merged[rank] = merged.get(rank, []) + changes
        return KVOffloadWorkerMetadata(merged, {**self.host_slots, **other.host_slots},
                                       {**self.reflected_step, **other.reflected_step})
