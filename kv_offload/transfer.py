"""Transfer jobs and results, and the interface of secondary storage tiers."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kv_offload.errors import TierRequestError

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


# Secondary tiers
#
# A secondary tier (disk, object store, remote memory...) sits behind the host-memory tier and
# only ever sees host buffers: 1-D uint8/int8 CPU tensors that are views into the host pool.
# It never touches engine tensors or the GPU. Keys are opaque bytes chosen by the caller; the
# same key always names the same bytes (keys are derived from content hashes), so a tier may
# skip rewriting a key it already holds.

HOST_BUFFER_DTYPES = (torch.uint8, torch.int8)


@dataclass(frozen=True)
class TierJobResult:
    """The outcome of one tier job: one success flag per key, in submission order."""

    job_id: int
    keys: tuple[bytes, ...]
    succeeded: tuple[bool, ...]

    @property
    def ok(self) -> bool:
        """True when every key of the job succeeded."""
        return all(self.succeeded)

    @property
    def failed_keys(self) -> tuple[bytes, ...]:
        """The keys that failed (a read left their buffer undefined; a write stored nothing)."""
        return tuple(k for k, ok in zip(self.keys, self.succeeded) if not ok)


class StorageTier(ABC):
    """A secondary tier that stores host buffers under opaque byte keys.

    Contract for implementers:
    - ``lookup`` answers from memory, never blocks on I/O: the scheduler calls it every step.
    - ``submit_write`` / ``submit_read`` return a job id at once and do the work in the
      background (or synchronously, for a tier that is fast enough). The caller keeps the
      buffers alive and untouched until that job id comes back from ``poll``.
    - Faults (missing, corrupt or foreign data, full or read-only storage) never raise: the key
      is reported as failed in the job's ``TierJobResult``. Only bad arguments raise, as
      ``TierRequestError`` (see ``check_tier_request``), and use after ``close`` raises
      ``TierClosedError``.
    - A read fills the caller's buffer in place; a key stored with a different size fails.
    """

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored. A hint: a later read may still fail (evicted, corrupt)."""

    @abstractmethod
    def submit_write(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        """Start storing ``buffers[i]`` under ``keys[i]``; return the job id."""

    @abstractmethod
    def submit_read(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        """Start filling ``buffers[i]`` with the bytes stored under ``keys[i]``; return job id."""

    @abstractmethod
    def poll(self) -> list[TierJobResult]:
        """Return the jobs finished since the last call, each exactly once. Never blocks."""

    @abstractmethod
    def close(self) -> None:
        """Wait for in-flight jobs (their results stay pollable) and release resources.

        Idempotent; submitting after close raises ``TierClosedError``.
        """

    def keys(self) -> list[bytes] | None:
        """Optional: every key held now, from memory (a connector reports them so its
        scheduler can offer hits, e.g. after a restart). None: the tier cannot list."""
        return None


def check_tier_keys(keys: Sequence[bytes], *, max_key_bytes: int | None = None) -> None:
    """Raise ``TierRequestError`` unless every key is non-empty ``bytes`` (of bounded length)."""
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or not key:
            raise TierRequestError(f"key {i} must be non-empty bytes, got {key!r}")
        if max_key_bytes is not None and len(key) > max_key_bytes:
            raise TierRequestError(
                f"key {i} ({key.hex()}) is {len(key)} bytes; this tier accepts at most "
                f"{max_key_bytes}"
            )


def check_tier_request(
    keys: Sequence[bytes],
    buffers: Sequence[torch.Tensor],
    *,
    max_key_bytes: int | None = None,
) -> None:
    """Raise ``TierRequestError`` unless keys and buffers form a valid tier request.

    Valid: as many buffers as keys, no key twice, every buffer a non-empty contiguous 1-D
    uint8/int8 CPU tensor.
    """
    if len(keys) != len(buffers):
        raise TierRequestError(
            f"got {len(keys)} keys but {len(buffers)} buffers; expected one buffer per key"
        )
    check_tier_keys(keys, max_key_bytes=max_key_bytes)
    if len(set(keys)) != len(keys):
        seen: set[bytes] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise TierRequestError(f"key {dup.hex()} appears twice in one request")
    for key, buf in zip(keys, buffers):
        problem = _host_buffer_problem(buf)
        if problem:
            raise TierRequestError(
                f"buffer for key {key.hex()}: {problem}; expected a non-empty contiguous 1-D "
                f"uint8/int8 CPU tensor"
            )


def _host_buffer_problem(buf: object) -> str | None:
    if not isinstance(buf, torch.Tensor):
        return f"got {type(buf).__name__}"
    if buf.device.type != "cpu":
        return f"device is {buf.device}"
    if buf.dtype not in HOST_BUFFER_DTYPES:
        return f"dtype is {buf.dtype}"
    if buf.dim() != 1:
        return f"shape is {tuple(buf.shape)}"
    if buf.numel() == 0:
        return "it is empty"
    if not buf.is_contiguous():
        return f"it is not contiguous (stride {buf.stride()})"
    return None
