"""What the GPU copier asks the runtime to do: addresses, pitches, sizes, and the rule
that picks a way to move each segment.

A segment (geometry.py) is a `(rows, refs, bytes)` strided view on each side. For a
group's plan, every (run, ref) is one `cudaMemcpy2DAsync`: `height` = the run's
length, each row one block's (or slot's) bytes of that ref, rows `pitch` bytes apart
on each side (`dma_calls`). The same rows as plain 1-D copies (`Copies`, rows merged
where they are contiguous on both sides) are the descriptors of a batched memcpy and,
cut into chunks, the pieces of the copy kernel.

The rule (`choose_path`), per segment, in one place. Its costs are published
numbers, not yet measured on our GPU path (see the README):
- `kernel` when there are more than `DMA_MAX_CALLS` pieces averaging under
  `KERNEL_PIECE_BYTES`: copy engines pay a fixed cost per small copy, SMs do not;
- else the DMA way with the cheaper enqueue: `MEMCPY_CALL_US` per 2D call, or
  `BATCH_CALL_US + BATCH_COPY_US` per copy for one batched call (CUDA 12.8+);
  a 2D call is only possible when both pitches are within the device's max pitch;
- unless that enqueue costs more than moving the bytes (`PCIE_BYTES_PER_US`) and
  more than `DMA_MAX_CALLS` 2D calls: then the CPU could not keep the copy engines
  busy, and the kernel (one launch) takes it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from kv_offload.errors import TransferError
from kv_offload.kernels.plan import GroupPlan

MEMCPY_CALL_US = 5.0  # one cudaMemcpy2DAsync / cudaMemcpyAsync enqueue (5-7 us published)
BATCH_CALL_US = 5.0  # one cudaMemcpyBatchAsync call ...
BATCH_COPY_US = 0.5  # ... plus this per copy in it (vLLM's measurement)
PCIE_BYTES_PER_US = 25_000  # 25 GB/s: what one direction of the copy engines sustains
DMA_MAX_CALLS = 64  # this many 2D calls are always cheap enough
KERNEL_PIECE_BYTES = 16 << 10  # below this mean size, many pieces go to the kernel
KERNEL_CHUNK_BYTES = 64 << 10  # kernel pieces are cut to this size (one thread block each)


class Path(enum.Enum):
    """A way to move a segment's bytes on the GPU."""

    DMA = "dma"  # one cudaMemcpy2DAsync per (run, ref)
    BATCH = "batch"  # the segment's copies in one cudaMemcpyBatchAsync
    KERNEL = "kernel"  # the copy kernel, one launch per job


@dataclass(frozen=True)
class Copies:
    """1-D copies: `size[i]` bytes from `src[i]` to `dst[i]` (int64 arrays)."""

    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray

    @property
    def count(self) -> int:
        return int(self.size.size)

    def chunked(self, chunk: int) -> Copies:
        """The same bytes, every copy cut into pieces of at most `chunk` bytes
        (`chunk` a multiple of 16: pieces keep their 16-byte alignment)."""
        parts = -(-self.size // chunk)
        if self.count == 0 or int(parts.max()) <= 1:
            return self
        first = np.repeat(np.cumsum(parts) - parts, parts)
        offset = (np.arange(int(parts.sum()), dtype=np.int64) - first) * chunk
        size = np.minimum(np.repeat(self.size, parts) - offset, chunk)
        return Copies(np.repeat(self.src, parts) + offset, np.repeat(self.dst, parts) + offset,
                      size)

    @staticmethod
    def concat(parts: list[Copies]) -> Copies:
        return Copies(*(np.concatenate([getattr(p, f) for p in parts]).astype(np.int64)
                        for f in ("src", "dst", "size")))


@dataclass(frozen=True)
class Memcpy2DCalls:
    """The `cudaMemcpy2DAsync` calls of one segment: call i copies `height[i]` rows
    of `width` bytes from `src[i]` (rows `spitch` apart) to `dst[i]` (`dpitch`)."""

    dst: np.ndarray
    dpitch: int
    src: np.ndarray
    spitch: int
    width: int
    height: np.ndarray

    @property
    def count(self) -> int:
        return int(self.height.size)

    @property
    def num_bytes(self) -> int:
        return int(self.height.sum()) * self.width

    @property
    def dense(self) -> bool:
        """Whether each call's rows are contiguous on both sides."""
        return self.dpitch == self.width and self.spitch == self.width

    @property
    def copy_count(self) -> int:
        """How many 1-D copies `copies` holds (without building them)."""
        return self.count if self.dense else int(self.height.sum())

    @cached_property
    def copies(self) -> Copies:
        """Every row as a 1-D copy; a call whose rows are contiguous on both sides
        is one copy."""
        if self.dense:
            return Copies(self.src, self.dst, self.height * self.width)
        rows = int(self.height.sum())
        first = np.repeat(np.cumsum(self.height) - self.height, self.height)
        row = np.arange(rows, dtype=np.int64) - first
        return Copies(np.repeat(self.src, self.height) + row * self.spitch,
                      np.repeat(self.dst, self.height) + row * self.dpitch,
                      np.full(rows, self.width, dtype=np.int64))


def _geometry(view: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(address of row 0, row stride, ref stride, refs, bytes per ref) in bytes."""
    item = view.element_size()
    return (view.data_ptr(), view.stride(0) * item, view.stride(1) * item, view.shape[1],
            view.shape[2] * item)


def dma_calls(src: torch.Tensor, dst: torch.Tensor, plan: GroupPlan) -> Memcpy2DCalls:
    """One 2D copy per (run, ref) of `plan` between segment views `src` and `dst`."""
    s0, s_row, s_ref, refs, nbytes = _geometry(src)
    d0, d_row, d_ref, _, _ = _geometry(dst)
    # A view of one row (one block) may fuse refs into a row wider than its stride; CUDA
    # checks `width <= pitch` even for one row, and any pitch moves one row right.
    s_row = max(s_row, nbytes) if src.shape[0] == 1 else s_row
    d_row = max(d_row, nbytes) if dst.shape[0] == 1 else d_row
    runs = plan.runs
    ref = np.arange(refs, dtype=np.int64)
    src_addr = (s0 + runs[:, 0:1] * s_row + ref * s_ref).reshape(-1)
    dst_addr = (d0 + runs[:, 1:2] * d_row + ref * d_ref).reshape(-1)
    heights = np.repeat(runs[:, 2], refs)
    return Memcpy2DCalls(dst_addr, d_row, src_addr, s_row, nbytes, heights)


def choose_path(calls: Memcpy2DCalls, *, batch_available: bool, max_pitch: int,
                forced: str | None = None) -> Path:
    """The way to move one segment's calls (see the module docstring). `forced`
    names a path (tests, benchmarks); an impossible one raises TransferError."""
    pitch_ok = calls.dpitch <= max_pitch and calls.spitch <= max_pitch
    if forced is not None:
        path = Path(forced) if forced in {p.value for p in Path} else None
        if path is None:
            raise TransferError(f"unknown GPU copy strategy {forced!r}; expected one of "
                                f"{sorted(p.value for p in Path)}")
        if path is Path.DMA and not pitch_ok:
            raise TransferError(f"a 2D copy cannot take pitches {calls.spitch}/{calls.dpitch}; "
                                f"the device allows at most {max_pitch}")
        if path is Path.BATCH and not batch_available:
            raise TransferError("the batched memcpy (cudaMemcpyBatchAsync) is not available")
        return path
    pieces = calls.copy_count
    if pieces == 0:
        return Path.DMA if pitch_ok else Path.KERNEL
    if pieces > DMA_MAX_CALLS and calls.num_bytes < pieces * KERNEL_PIECE_BYTES:
        return Path.KERNEL
    costs = {}
    if pitch_ok:
        costs[Path.DMA] = calls.count * MEMCPY_CALL_US
    if batch_available:
        costs[Path.BATCH] = BATCH_CALL_US + pieces * BATCH_COPY_US
    if not costs:
        return Path.KERNEL
    best = min(costs, key=costs.__getitem__)  # a tie keeps the 2D calls
    budget = max(DMA_MAX_CALLS * MEMCPY_CALL_US, calls.num_bytes / PCIE_BYTES_PER_US)
    return best if costs[best] <= budget else Path.KERNEL
