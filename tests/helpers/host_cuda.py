"""A host executor of the CUDA runtime calls the GPU copier makes (`CudaRuntime`).

Written from the CUDA runtime documentation, not from our planner, so that running
`CudaCopier` against it proves the addresses, pitches, sizes and the stream order
the copier produces, on real memory:
- streams are FIFO queues of work; work runs only when the executor advances
  (`query`, `synchronize`, `release`, `run`), never while it is being enqueued, so
  a copier that forgets to wait for something finds it not done yet. Streams made
  later run first, so copy streams get ahead of the engine's stream unless an
  event holds them back;
- `record` captures the stream's work so far; `stream_wait_event` makes later work
  on the stream wait for the event's most recent record at the time of the call
  (an event never recorded: no wait); `query` says whether that record completed;
- `cudaMemcpy2DAsync`: `height` rows of `width` bytes, row r from `src + r*spitch`
  to `dst + r*dpitch`. Refused at the call (as the runtime returns an error):
  `width` above either pitch or a pitch above the device's maximum
  (cudaErrorInvalidPitchValue), an unknown kind, overlapping areas, and addresses
  outside known memory (cudaErrorInvalidValue);
- `cudaMemcpyBatchAsync`: `dsts`, `srcs`, `sizes` of one length `count`; `attrs`
  and `attrs_idxs` of one length, at most `count`; `attrs_idxs[0] == 0`, strictly
  increasing, below `count`; a valid `srcAccessOrder`; not the legacy NULL stream
  (all cudaErrorInvalidValue). Copies of one batch run in no particular order
  (here: last first), so dependent (overlapping) copies are refused;
- a kernel launch runs the source the copier compiled, built for the host
  (`host_kernel.py`), with argument values captured at launch.
Known memory is what the test `register`s as device memory plus `pinned_empty`
buffers. Every call is appended to `calls`, for order checks.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kv_offload.errors import TransferError
from kv_offload.kernels.runtime import DEFAULT_MAX_PITCH, CudaRuntime, MemcpyAttributes

from helpers.host_kernel import compile_kernel

MEMCPY_KINDS = {0, 1, 2, 3, 4}  # HostToHost .. Default
SRC_ACCESS_ORDERS = {1, 2, 3}  # Stream, DuringApiCall, Any
MAX_BLOCK_THREADS = 1024
MAX_GRID_X = 2**31 - 1


class HostCudaError(RuntimeError):
    """What the CUDA runtime would have returned instead of cudaSuccess."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code


@dataclass(eq=False)
class _Mark:
    """One record of an event: done once the stream reached it."""

    done: bool = False


@dataclass(eq=False)
class HostEvent:
    handle: int
    latest: _Mark | None = None


@dataclass(eq=False)
class _Op:
    label: str
    run: Callable[[], None] = lambda: None
    waits_for: _Mark | None = None


@dataclass(eq=False)
class HostStream:
    handle: int
    name: str
    ops: deque = field(default_factory=deque)
    held: bool = False


@dataclass(frozen=True)
class _Region:
    start: int
    end: int
    kind: str  # "device" or "pinned"


class HostCudaRuntime(CudaRuntime):
    def __init__(self, *, batch: bool = True, batch_fails: bool = False,
                 max_pitch: int = DEFAULT_MAX_PITCH, sync_timeout_s: float = 10.0,
                 multiprocessors: int = 0) -> None:
        self.max_pitch = max_pitch
        self.multiprocessors = multiprocessors
        self._batch = batch
        self._batch_fails = batch_fails
        self._sync_timeout_s = sync_timeout_s
        self._cond = threading.Condition(threading.RLock())
        self._handles = itertools.count(1)
        self.engine = HostStream(0, "engine")  # the legacy default stream, vLLM's here
        self._streams = [self.engine]
        self._regions: list[_Region] = []
        self._keep: list[torch.Tensor] = []
        self.calls: list[tuple] = []
        self.pinned_allocations = 0
        self.sticky_error: Exception | None = None

    # --- test controls ---

    def register(self, tensor: torch.Tensor, kind: str = "device") -> None:
        """Make a tensor's bytes known memory (CPU tensors stand in for device memory)."""
        start = tensor.untyped_storage().data_ptr()
        with self._cond:
            region = _Region(start, start + tensor.untyped_storage().nbytes(), kind)
            bisect.insort(self._regions, region, key=lambda r: r.start)
            self._keep.append(tensor)

    def hold(self, stream: HostStream) -> None:
        with self._cond:
            stream.held = True

    def release(self, stream: HostStream) -> None:
        with self._cond:
            stream.held = False
            self._progress()

    def enqueue_host(self, stream: HostStream, fn: Callable[[], None], label: str) -> None:
        """Host work in stream order (cudaLaunchHostFunc): the engine's forward here."""
        with self._cond:
            self.calls.append(("host", label, stream.handle))
            stream.ops.append(_Op(label, fn))

    def run(self) -> None:
        with self._cond:
            self._progress()

    def count(self, call: str) -> int:
        return sum(1 for c in self.calls if c[0] == call)

    # --- streams and events ---

    def current_stream(self) -> HostStream:
        return self.engine

    def new_stream(self) -> HostStream:
        with self._cond:
            stream = HostStream(next(self._handles), f"stream{len(self._streams)}")
            self._streams.append(stream)
            return stream

    def new_event(self) -> HostEvent:
        with self._cond:
            return HostEvent(next(self._handles))

    def record(self, event: HostEvent, stream: HostStream) -> None:
        with self._cond:
            mark = event.latest = _Mark()
            self.calls.append(("record", event.handle, stream.handle))
            stream.ops.append(_Op(f"record {event.handle}", lambda: setattr(mark, "done", True)))

    def stream_wait_event(self, stream: HostStream, event: HostEvent) -> None:
        with self._cond:
            self.calls.append(("wait", stream.handle, event.handle))
            if event.latest is not None:
                stream.ops.append(_Op(f"wait {event.handle}", waits_for=event.latest))

    def query(self, event: HostEvent) -> bool:
        with self._cond:
            self.calls.append(("query", event.handle))
            self._progress()
            self._raise_sticky()
            return event.latest is None or event.latest.done

    def synchronize(self, event: HostEvent) -> None:
        with self._cond:
            self.calls.append(("synchronize", event.handle))
            self._progress()
            if not self._cond.wait_for(lambda: event.latest is None or event.latest.done,
                                       timeout=self._sync_timeout_s):
                raise HostCudaError("deadlock", f"event {event.handle} never completes: "
                                    f"held streams {[s.name for s in self._streams if s.held]}")
            self._raise_sticky()

    # --- moving bytes ---

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                       height: int, kind: int, stream: HostStream) -> None:
        if kind not in MEMCPY_KINDS:
            raise HostCudaError("cudaErrorInvalidMemcpyDirection", f"kind {kind}")
        if width > dpitch or width > spitch:
            raise HostCudaError("cudaErrorInvalidPitchValue",
                                f"width {width} exceeds dpitch {dpitch} or spitch {spitch}")
        if dpitch > self.max_pitch or spitch > self.max_pitch:
            raise HostCudaError("cudaErrorInvalidPitchValue",
                                f"pitch {max(dpitch, spitch)} > maximum {self.max_pitch}")
        with self._cond:
            self.calls.append(("memcpy2d", stream.handle, dst, dpitch, src, spitch, width, height))
            if width == 0 or height == 0:
                return
            dst_end = dst + (height - 1) * dpitch + width
            src_end = src + (height - 1) * spitch + width
            self._check(dst, dst_end, "dst")
            self._check(src, src_end, "src")
            if dst < src_end and src < dst_end:
                raise HostCudaError("cudaErrorInvalidValue", "source and destination overlap")

            def rows() -> None:
                for r in range(height):
                    ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

            stream.ops.append(_Op("memcpy2d", rows))

    @property
    def batch_available(self) -> bool:
        return self._batch

    def memcpy_batch_async(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                           attrs: Sequence[MemcpyAttributes], attrs_idxs: Sequence[int],
                           stream: HostStream) -> None:
        invalid = "cudaErrorInvalidValue"
        if not self._batch:
            raise HostCudaError("cudaErrorNotSupported", "no cudaMemcpyBatchAsync here")
        if self._batch_fails:
            raise HostCudaError("cudaErrorInsufficientDriver", "simulated old driver")
        dsts, srcs, sizes = (np.asarray(a, dtype=np.int64) for a in (dsts, srcs, sizes))
        count, idxs = sizes.size, list(attrs_idxs)
        if stream.handle == self.engine.handle:
            raise HostCudaError(invalid, "the legacy NULL stream is not allowed")
        if count == 0 or dsts.size != count or srcs.size != count:
            raise HostCudaError(invalid, f"dsts/srcs/sizes of {dsts.size}/{srcs.size}/{count}")
        if not 1 <= len(attrs) <= count or len(idxs) != len(attrs):
            raise HostCudaError(invalid, f"{len(attrs)} attrs, {len(idxs)} attrs_idxs")
        if idxs[0] != 0 or any(b <= a for a, b in zip(idxs, idxs[1:])) or idxs[-1] >= count:
            raise HostCudaError(invalid, f"attrs_idxs {idxs} for {count} copies")
        if any(a.src_access_order not in SRC_ACCESS_ORDERS for a in attrs):
            raise HostCudaError(invalid, "a copy without a valid srcAccessOrder")
        with self._cond:
            self.calls.append(("batch", stream.handle, count))
            for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
                self._check(d, d + n, "dst")
                self._check(s, s + n, "src")
            _check_independent(dsts, srcs, sizes)
            order = list(range(count))[::-1]  # no order within a batch: not the given one

            def copies() -> None:
                for i in order:
                    ctypes.memmove(int(dsts[i]), int(srcs[i]), int(sizes[i]))

            stream.ops.append(_Op("batch", copies))

    def compile_kernel(self, source: str, name: str) -> object:
        self.calls.append(("compile", name))
        return compile_kernel(source, name)

    def launch(self, kernel, grid: int, block: int, args: Sequence[np.generic],
               stream: HostStream) -> None:
        if not 1 <= grid <= MAX_GRID_X or not 1 <= block <= MAX_BLOCK_THREADS:
            raise HostCudaError("cudaErrorInvalidConfiguration", f"grid {grid} block {block}")
        values = [np.array(a) for a in args]  # captured now, as cuLaunchKernel does
        with self._cond:
            self.calls.append(("launch", stream.handle, grid, block))
            stream.ops.append(_Op("kernel",
                                  lambda: kernel((grid, 1, 1), (block, 1, 1), values)))

    # --- host memory ---

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
        shift = (-raw.data_ptr()) % 4096  # pinned memory starts on a page
        buffer = raw[shift:shift + nbytes]
        self.register(raw, "pinned")
        with self._cond:
            self.pinned_allocations += 1
        return buffer

    def check_host_pool(self, pool: torch.Tensor) -> None:
        start = pool.data_ptr()
        region = self._region(start, start + pool.numel() * pool.element_size())
        if region is None or region.kind != "pinned":
            raise TransferError("the host pool must be pinned memory (pinned_empty)")

    # --- internals ---

    def _progress(self) -> None:
        """Run every stream's work as far as it can go (lock held)."""
        moved = True
        while moved:
            moved = False
            for stream in reversed(self._streams):
                while stream.ops and not stream.held:
                    op = stream.ops[0]
                    if op.waits_for is not None and not op.waits_for.done:
                        break
                    stream.ops.popleft()
                    self.calls.append(("exec", op.label, stream.handle))
                    try:
                        op.run()
                    except Exception as exc:  # an async failure: reported by later calls
                        self.sticky_error = self.sticky_error or exc
                    moved = True
        self._cond.notify_all()

    def _raise_sticky(self) -> None:
        if self.sticky_error is not None:
            raise HostCudaError("cudaErrorLaunchFailure", str(self.sticky_error))

    def _region(self, start: int, end: int) -> _Region | None:
        i = bisect.bisect_right([r.start for r in self._regions], start) - 1
        if i >= 0 and end <= self._regions[i].end:
            return self._regions[i]
        # Overlapping registrations (a view of a registered tensor): try every one.
        return next((r for r in self._regions if r.start <= start and end <= r.end), None)

    def _check(self, start: int, end: int, what: str) -> None:
        if self._region(start, end) is None:
            raise HostCudaError("cudaErrorInvalidValue",
                                f"{what} [{start:#x}, {end:#x}) is outside known memory")


def _check_independent(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
    """Copies of a batch must not depend on each other: no two destinations overlap,
    and no source overlaps a destination."""
    order = np.argsort(dsts, kind="stable")
    starts, ends = dsts[order], dsts[order] + sizes[order]
    if starts.size > 1 and (ends[:-1] > starts[1:]).any():
        raise HostCudaError("cudaErrorInvalidValue", "two copies of a batch write one byte")
    at = np.searchsorted(starts, srcs + sizes, side="left")  # dsts starting before src end
    prev = np.maximum(at - 1, 0)
    hit = (at > 0) & (ends[prev] > srcs)
    if hit.any():
        raise HostCudaError("cudaErrorInvalidValue", "a copy reads bytes another one writes")
