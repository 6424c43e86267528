"""GPU executor: engine memory on a GPU, host pool in pinned memory.

`CudaCopier.submit(plan, ready)` turns a plan into runtime calls on the
direction's own stream and returns a `CudaJob` at once; nothing waits on the host:
1. the stream waits (on the GPU) for `ready`, an event recorded on the engine's
   stream: a store reads blocks only after the forward that wrote them, a load
   writes blocks only after the engine's own work on them (e.g. zeroing);
2. each segment moves by the path `cuda_calls.choose_path` picks: 2D copies on
   the copy engines, one batched memcpy (CUDA 12.8+), or the copy kernel below;
3. an event is recorded; `CudaJob.done()` queries it, `wait()` blocks on it.

Stores and loads have their own streams, so they overlap on separate copy
engines; several jobs of one direction may be in flight, in stream order. The
kernel reads its descriptors (src, dst, bytes) straight from pinned host memory
(unified addressing), from buffers of a `DescriptorPool`: a buffer returns to
the pool when its job is seen complete, by `done()` or by `wait()`, never before.

The runtime calls go through a `CudaRuntime` (runtime.py): cupy and torch on a
GPU, a host executor of the same calls in the tests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import numpy as np
import torch

from kv_offload.kernels.cuda_calls import (
    Copies,
    Memcpy2DCalls,
    Path,
    choose_path,
    dma_calls,
    kernel_chunk_bytes,
)
from kv_offload.kernels.geometry import Segment
from kv_offload.kernels.plan import CopyPlan, Direction
from kv_offload.kernels.runtime import (
    LOCATION_DEVICE,
    LOCATION_HOST,
    MEMCPY_DEFAULT,
    CudaRuntime,
    EngineReady,
    MemcpyAttributes,
)

logger = logging.getLogger(__name__)

THREADS = 256
MAX_GRID = 65535
DESCRIPTOR_BYTES = 24  # (src, dst, bytes) as three 64-bit words
MIN_DESCRIPTOR_BUFFER = 4096  # bytes; buffers come in powers of two from here
KEEP_FREE_BUFFERS = 4  # per size: more free buffers than this are dropped

COPY_KERNEL_NAME = "copy_pieces"
COPY_KERNEL_SOURCE = r"""
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


def plan_calls(segments: list[list[Segment]], plan: CopyPlan) -> Iterator[Memcpy2DCalls]:
    """The 2D calls of each segment a plan touches, source to destination in its direction."""
    for group_plan in plan.groups:
        for segment in segments[group_plan.group]:
            src, dst = ((segment.engine, segment.host) if plan.direction is Direction.STORE
                        else (segment.host, segment.engine))
            yield dma_calls(src, dst, group_plan)


def kernel_grid(pieces: int, multiprocessors: int) -> int:
    """Thread blocks for a launch over `pieces`: one per SM at most (each loops over
    its share). Measured on an H200 (132 SMs, benchmarks/bench_cuda_paths.py
    --kernel-grid): a grid of 132 moved the bytes as fast as one block per piece (median
    time ratio 1.00 over 48 jobs), and leaves the SMs it does not need to the engine."""
    cap = min(MAX_GRID, multiprocessors) if multiprocessors > 0 else MAX_GRID
    return max(1, min(pieces, cap))


class DescriptorPool:
    """Pinned buffers for kernel descriptors, reused: pinning memory is slow (it
    maps pages for the device), a launch should not pay for it."""

    def __init__(self, runtime: CudaRuntime) -> None:
        self._runtime = runtime
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocations = 0  # pinned buffers made so far (tests, benchmarks)

    def acquire(self, nbytes: int) -> torch.Tensor:
        size = max(MIN_DESCRIPTOR_BUFFER, 1 << (nbytes - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
            self.allocations += 1
        return self._runtime.pinned_empty(size)

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            free = self._free.setdefault(buffer.numel(), [])
            if len(free) < KEEP_FREE_BUFFERS:
                free.append(buffer)

    @property
    def free_buffers(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._free.values())


class CudaJob:
    """A submitted plan: `done()` polls its event, `wait()` blocks on it. Either,
    once it sees the job complete, hands the job's descriptor buffers back."""

    def __init__(self, runtime: CudaRuntime, pool: DescriptorPool) -> None:
        self._runtime = runtime
        self._pool = pool
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []
        self.event: object | None = None
        self.error: Exception | None = None  # a runtime call failed: the job failed
        self.paths: set[Path] = set()

    def hold(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._buffers.append(buffer)

    def done(self) -> bool:
        try:
            if self.event is not None and not self._runtime.query(self.event):
                return False
        except Exception:
            self._release()  # a failed context runs nothing more
            raise
        self._release()
        return True

    def wait(self) -> None:
        try:
            if self.event is not None:
                self._runtime.synchronize(self.event)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            buffers, self._buffers = self._buffers, []
        for buffer in buffers:
            self._pool.release(buffer)


class CudaCopier:
    def __init__(self, segments: list[list[Segment]], runtime: CudaRuntime) -> None:
        self._segments = segments
        self._runtime = runtime
        with runtime.activate():
            self._streams = {d: runtime.new_stream() for d in Direction}
            self._kernel = runtime.compile_kernel(COPY_KERNEL_SOURCE, COPY_KERNEL_NAME)
        self.descriptors = DescriptorPool(runtime)
        self._batch = runtime.batch_available  # off for good after a failed batch call
        self.last_paths: dict[Direction, tuple[str, ...]] = {}

    def submit(self, plan: CopyPlan, ready: EngineReady | None = None,
               strategy: str | None = None) -> CudaJob:
        """Enqueue `plan` on its direction's stream after `ready` (None: after
        nothing). A failed runtime call fails the job (`CudaJob.error`); copies
        already enqueued still complete before its event does."""
        runtime = self._runtime
        stream = self._streams[plan.direction]
        job = CudaJob(runtime, self.descriptors)
        with runtime.activate():
            try:
                if ready is not None and ready.event is not None:
                    runtime.stream_wait_event(stream, ready.event)
                self._enqueue(plan, stream, job, strategy)
            except Exception as exc:
                job.error = exc
            try:
                event = runtime.new_event()
                runtime.record(event, stream)
                job.event = event
            except Exception as exc:  # no event: the context is broken, nothing completes
                job.error = job.error or exc
        self.last_paths[plan.direction] = tuple(sorted(p.value for p in job.paths))
        return job

    def _enqueue(self, plan: CopyPlan, stream: object, job: CudaJob,
                 strategy: str | None) -> None:
        batched: list[Memcpy2DCalls] = []
        pieces: list[Copies] = []
        for calls in plan_calls(self._segments, plan):
            path = self._path(calls, strategy)
            job.paths.add(path)
            if path is Path.DMA:
                self._memcpy2d(calls, stream)
            elif path is Path.BATCH:
                batched.append(calls)
            else:
                pieces.append(calls.copies)
        if batched and not self._memcpy_batch(batched, plan.direction, stream):
            job.paths.discard(Path.BATCH)
            for calls in batched:  # the fallback: the same copies without the batch
                path = self._path(calls, None)
                job.paths.add(path)
                if path is Path.DMA:
                    self._memcpy2d(calls, stream)
                else:
                    pieces.append(calls.copies)
        if pieces:
            copies = Copies.concat(pieces)
            self._launch(copies.chunked(kernel_chunk_bytes(int(copies.size.sum()))), stream,
                         job)

    def _path(self, calls: Memcpy2DCalls, strategy: str | None) -> Path:
        return choose_path(calls, batch_available=self._batch,
                           max_pitch=self._runtime.max_pitch, forced=strategy)

    def _memcpy2d(self, calls: Memcpy2DCalls, stream: object) -> None:
        for d, s, h in zip(calls.dst.tolist(), calls.src.tolist(), calls.height.tolist()):
            self._runtime.memcpy2d_async(d, calls.dpitch, s, calls.spitch, calls.width, h,
                                         MEMCPY_DEFAULT, stream)

    def _memcpy_batch(self, batched: list[Memcpy2DCalls], direction: Direction,
                      stream: object) -> bool:
        """One batched call for every batched segment; False (and the batch is off
        from now on) if the runtime refused it. Copies are idempotent, so whatever
        a refused call did enqueue is harmless to enqueue again another way."""
        copies = Copies.concat([c.copies for c in batched])
        engine, host = LOCATION_DEVICE, LOCATION_HOST
        src, dst = (engine, host) if direction is Direction.STORE else (host, engine)
        attrs = MemcpyAttributes(src_location=src, dst_location=dst,
                                 device=self._runtime.device_index)
        try:
            self._runtime.memcpy_batch_async(copies.dst, copies.src, copies.size, [attrs], [0],
                                             stream)
        except Exception as exc:
            self._batch = False
            logger.warning("kv-offload: the batched memcpy failed (%s); using 2D copies and "
                           "the copy kernel from now on", exc)
            return False
        return True

    def _launch(self, copies: Copies, stream: object, job: CudaJob) -> None:
        count = copies.count
        buffer = self.descriptors.acquire(count * DESCRIPTOR_BYTES)
        job.hold(buffer)  # from now until the job is seen complete
        table = buffer[:count * DESCRIPTOR_BYTES].view(torch.int64).view(count, 3).numpy()
        table[:, 0], table[:, 1], table[:, 2] = copies.src, copies.dst, copies.size
        self._runtime.launch(self._kernel, kernel_grid(count, self._runtime.multiprocessors),
                             THREADS,
                             (np.uint64(buffer.data_ptr()), np.int64(count)), stream)

