"""Transfer jobs and results of the host-memory tier (engine blocks <-> host slots).

The interface of secondary tiers lives in `kv_offload.backends.base`."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

# Jobs and results
#
# The primary (host-memory) tier moves blocks between engine memory and host slots in jobs.
# A job names, per cache group, engine block ids and host slot ids (pair i moves block_ids[i]
# <-> slot_ids[i]). Every job ends with exactly one TransferResult; a failed job lists the
# blocks whose bytes did not arrive, and the engine recomputes them.


class Direction(enum.Enum):
    """Which way a job moves bytes."""

    STORE = "store"  # engine blocks -> host slots
    LOAD = "load"  # host slots -> engine blocks


@dataclass(frozen=True, eq=False)
class BlockTransfer:
    """The pairs of one cache group in a job (1-D int64 arrays, not to be modified)."""

    group: int
    block_ids: np.ndarray
    slot_ids: np.ndarray


@dataclass(frozen=True)
class TransferJob:
    job_id: int
    direction: Direction
    transfers: tuple[BlockTransfer, ...]

    @property
    def num_blocks(self) -> int:
        return sum(t.block_ids.size for t in self.transfers)


@dataclass(frozen=True)
class TransferResult:
    """The outcome of one job. On failure `failed_blocks` holds (group, block ids) of
    every block whose bytes may be missing or partial (for a load: recompute them; for a
    store: the slots hold nothing usable), and `error` says why."""

    job_id: int
    direction: Direction
    success: bool
    num_bytes: int
    seconds: float
    failed_blocks: tuple[tuple[int, tuple[int, ...]], ...] = ()
    error: str | None = None
