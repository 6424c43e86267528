"""CUDA executor: engine memory on a GPU, host pool in pinned memory.

Two ways to move a plan, picked per segment by a simple rule:
- dma: one `cudaMemcpy2DAsync` per merged run (and ref), on the copy engines.
  cupy exposes no batched memcpy (`cudaMemcpyBatchAsync`); if a cupy release
  adds `runtime.memcpyBatchAsync` it is not used yet, merging keeps calls few.
- kernel: many small pieces (short runs of small pages) in one launch of a
  copy kernel that reads and writes pinned host memory directly (UVA: the
  host pointer is valid on the device), 16-byte accesses when aligned.
Rule: dma when it needs at most `DMA_MAX_CALLS` calls or its pieces average at
least `DMA_MIN_BYTES`; else the kernel.

Stores and loads use their own streams, so they overlap on separate copy
engines. `submit` enqueues and records an event; nothing waits on the host.
cupy is an optional dependency (`kv_offload[cuda]`): this module is imported
only when engine memory is on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kv_offload.kernels.geometry import Segment
from kv_offload.kernels.plan import CopyPlan, Direction, GroupPlan

DMA_MAX_CALLS = 64
DMA_MIN_BYTES = 256 << 10
THREADS = 256
MAX_GRID = 65535

_SOURCE = r"""
extern "C" __global__ void copy_pieces(const unsigned long long* __restrict__ desc,
                                       long long count) {
    for (long long i = blockIdx.x; i < count; i += gridDim.x) {
        const char* src = (const char*)desc[3 * i];
        char* dst = (char*)desc[3 * i + 1];
        unsigned long long n = desc[3 * i + 2];
        if ((((unsigned long long)src | (unsigned long long)dst | n) & 15ULL) == 0) {
            const int4* s = (const int4*)src;
            int4* d = (int4*)dst;
            for (unsigned long long j = threadIdx.x; j < n / 16; j += blockDim.x) d[j] = s[j];
        } else {
            for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) dst[j] = src[j];
        }
    }
}
"""


@dataclass
class CudaHandle:
    """A submitted plan: poll with `done()`, block with `wait()`. Keeps the
    descriptor buffers alive until the copy has finished."""

    event: torch.cuda.Event
    keep_alive: list

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()
        self.keep_alive.clear()


class CudaCopier:
    def __init__(self, segments: list[list[Segment]], device: torch.device) -> None:
        import cupy  # optional dependency

        self._cupy = cupy
        self._segments = segments
        self._device = device
        self._streams = {d: torch.cuda.Stream(device) for d in Direction}
        with cupy.cuda.Device(device.index or 0):
            self._kernel = cupy.RawKernel(_SOURCE, "copy_pieces")
        for group in segments:
            for segment in group:
                if not segment.host.is_pinned():
                    raise ValueError("the host pool must be pinned for GPU copies")

    def submit(self, plan: CopyPlan, after: torch.cuda.Event | None = None,
               strategy: str | None = None) -> CudaHandle:
        """Enqueue `plan` on its direction's stream after `after` (default: after
        the work already queued on the submitting thread's current stream)."""
        stream = self._streams[plan.direction]
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream(self._device))
        keep: list = []
        with torch.cuda.stream(stream):
            pieces = []
            for group_plan in plan.groups:
                for segment in self._segments[group_plan.group]:
                    src, dst = ((segment.engine, segment.host)
                                if plan.direction is Direction.STORE
                                else (segment.host, segment.engine))
                    calls = _dma_calls(src, dst, group_plan)
                    use_dma = strategy == "dma" or (strategy is None and (
                        len(calls[0]) <= DMA_MAX_CALLS
                        or calls[3].mean() * calls[4].mean() >= DMA_MIN_BYTES))
                    if use_dma:
                        self._dma(stream, *calls)
                    else:
                        pieces.append(_pieces(src, dst, group_plan))
            if pieces:
                self._launch(stream, np.concatenate(pieces), keep)
            event = torch.cuda.Event()
            event.record(stream)
        return CudaHandle(event, keep)

    def _dma(self, stream: torch.cuda.Stream, dst: np.ndarray, dpitch: int, src: np.ndarray,
             width: np.ndarray, height: np.ndarray, spitch: int) -> None:
        runtime = self._cupy.cuda.runtime
        kind = runtime.memcpyDefault
        for d, s, w, h in zip(dst.tolist(), src.tolist(), width.tolist(), height.tolist()):
            runtime.memcpy2DAsync(d, dpitch, s, spitch, w, h, kind, stream.cuda_stream)

    def _launch(self, stream: torch.cuda.Stream, desc: np.ndarray, keep: list) -> None:
        host = torch.from_numpy(desc.reshape(-1).view(np.int64)).pin_memory()
        device = host.to(self._device, non_blocking=True)
        keep.extend([host, device])  # freed only after the event has fired
        count = desc.shape[0]
        grid = (min(count, MAX_GRID),)
        cupy_stream = self._cupy.cuda.ExternalStream(stream.cuda_stream)
        self._kernel(grid, (THREADS,), (self._cupy.uint64(device.data_ptr()),
                                        self._cupy.int64(count)), stream=cupy_stream)


def _geometry(view: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(address of row 0, row stride, ref stride, refs, bytes per ref) in bytes."""
    item = view.element_size()
    return (view.data_ptr(), view.stride(0) * item, view.stride(1) * item, view.shape[1],
            view.shape[2] * item)


def _dma_calls(src: torch.Tensor, dst: torch.Tensor, plan: GroupPlan):
    """memcpy2D arguments for each (run, ref): rows of one ref, `height` = run
    length. Returns (dst addrs, dst pitch, src addrs, widths, heights, src pitch)."""
    s0, s_row, s_ref, refs, nbytes = _geometry(src)
    d0, d_row, d_ref, _, _ = _geometry(dst)
    runs = plan.runs
    ref = np.arange(refs, dtype=np.int64)
    src_addr = (s0 + runs[:, 0:1] * s_row + ref * s_ref).reshape(-1)
    dst_addr = (d0 + runs[:, 1:2] * d_row + ref * d_ref).reshape(-1)
    heights = np.repeat(runs[:, 2], refs)
    widths = np.full_like(heights, nbytes)
    return dst_addr, d_row, src_addr, widths, heights, s_row


def _pieces(src: torch.Tensor, dst: torch.Tensor, plan: GroupPlan) -> np.ndarray:
    """(src addr, dst addr, bytes) for every (pair, ref), as uint64 rows."""
    s0, s_row, s_ref, refs, nbytes = _geometry(src)
    d0, d_row, d_ref, _, _ = _geometry(dst)
    ref = np.arange(refs, dtype=np.int64)
    src_addr = (s0 + plan.src[:, None] * s_row + ref * s_ref).reshape(-1)
    dst_addr = (d0 + plan.dst[:, None] * d_row + ref * d_ref).reshape(-1)
    sizes = np.full_like(src_addr, nbytes)
    return np.stack([src_addr, dst_addr, sizes], axis=1).astype(np.uint64)
