"""What the GPU copier asks the runtime to do: addresses, pitches, sizes, and the rule
that picks a way to move each segment.

A segment (geometry.py) is a `(rows, refs, bytes)` strided view on each side. For a
group's plan, every (run, ref) is one `cudaMemcpy2DAsync`: `height` = the run's
length, each row one block's (or slot's) bytes of that ref, rows `pitch` bytes apart
on each side (`dma_calls`). The same rows as plain 1-D copies (`Copies`, rows merged
where they are contiguous on both sides) are the descriptors of a batched memcpy and,
cut into chunks, the pieces of the copy kernel.

The rule (`choose_path`), per segment, in one place, set from measurements on an
NVIDIA H200 (PCIe gen 5 x16: 55 GB/s each way for one pinned buffer; driver 580, cupy
14.2, cuda-bindings 13.3): `benchmarks/bench_cuda_paths.py`, docs/benchmarks.md.
- Each way costs its enqueue plus its bytes at its measured rate: 2D copies
  `MEMCPY_CALL_US` per call + bytes / `DMA_BYTES_PER_US`; the kernel
  `KERNEL_LAUNCH_US` + bytes / `KERNEL_BYTES_PER_US`. The cheaper wins; a tie keeps
  the 2D copies (they leave the SMs to the engine). So few long 2D copies (a prompt's
  consecutive blocks into consecutive slots) go to the copy engines, and one copy per
  block and page (scattered blocks) goes to the kernel, which moved 2 KiB pieces at
  28 GB/s where 2D copies reached 1 GB/s.
- A 2D call needs both pitches within the device's max pitch; else the kernel.
- The batched memcpy is never the rule's choice: measured, it costs 0.7 us (stores) to
  1.7 us (loads) of host time per copy and lost to the kernel in every cell. It stays
  for `forced="batch"` (benchmarks, and other drivers' measurements).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from kv_offload.errors import TransferError
from kv_offload.kernels.plan import GroupPlan

MEMCPY_CALL_US = 2.2  # host time of one cudaMemcpy2DAsync through cupy (2.0-2.5 measured)
DMA_BYTES_PER_US = 50_000  # 2D copies of rows >= 32 KiB: 51 GB/s measured (narrow rows: less)
KERNEL_LAUNCH_US = 100.0  # the kernel's fixed extra: descriptors, their table, the launch
# (jobs of 32 2D calls: the kernel lost to them by 20-60 us; 80-120 fit the cells best)
KERNEL_BYTES_PER_US = 45_000  # the kernel over pinned memory: 46-48 GB/s for >= 16 KiB pieces
KERNEL_CHUNK_BYTES = 64 << 10  # the largest kernel piece (one thread block's turn)
KERNEL_MIN_CHUNK_BYTES = 4 << 10  # ... and the smallest a copy is cut into
KERNEL_TARGET_PIECES = 1024  # a small job is cut finer, to keep this many blocks busy


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


def kernel_chunk_bytes(total_bytes: int) -> int:
    """The size the kernel's copies are cut to for a job of `total_bytes`: at most
    `KERNEL_CHUNK_BYTES`, smaller for small jobs so that they still spread over many
    thread blocks (a read over PCIe waits microseconds; few blocks cannot hide it);
    a multiple of 16, so pieces keep their 16-byte alignment."""
    chunk = total_bytes // KERNEL_TARGET_PIECES // 16 * 16
    return max(KERNEL_MIN_CHUNK_BYTES, min(KERNEL_CHUNK_BYTES, chunk))


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
    if not pitch_ok:
        return Path.KERNEL
    if calls.count == 0:
        return Path.DMA
    dma_us = calls.count * MEMCPY_CALL_US + calls.num_bytes / DMA_BYTES_PER_US
    kernel_us = KERNEL_LAUNCH_US + calls.num_bytes / KERNEL_BYTES_PER_US
    return Path.DMA if dma_us <= kernel_us else Path.KERNEL
