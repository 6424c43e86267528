"""The CUDA runtime calls the GPU copier makes, behind one small interface.

Contents:
- `CudaRuntime`: streams, events, the three ways to move bytes (`memcpy2d_async`,
  `memcpy_batch_async`, a copy kernel), pinned buffers, and the host pool check.
- `EngineReady`: an event recorded on the engine's stream; a copy waits for it.
- `MemcpyAttributes` and the constants of the CUDA runtime the calls use.

Why a seam: the copier (`kernels/cuda.py`) decides *what* to copy (addresses,
pitches, descriptors, streams, events); a runtime *performs* it. In production
that is `CupyRuntime` (`kernels/cuda_runtime.py`: cupy, torch streams and
events, NVIDIA's cuda-python for the batched copy). On a machine without a GPU
the tests plug in a host executor of the same calls, written from the CUDA
runtime documentation (row copies, batches, stream order, events), so the very
copier code that runs on a GPU is executed on real memory and compared byte for
byte with the CPU path.

The calls mirror the CUDA runtime API one to one, with the argument order of
the documentation: `memcpy2d_async(dst, dpitch, src, spitch, width, height,
kind, stream)` is `cudaMemcpy2DAsync`; `memcpy_batch_async(dsts, srcs, sizes,
attrs, attrs_idxs, stream)` is `cudaMemcpyBatchAsync`; `launch` is a kernel
launch with `cuLaunchKernel`'s argument convention (values captured at launch).
Streams and events are opaque handles of the runtime that made them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kv_offload.errors import TransferError

# cudaMemcpyKind: the direction is inferred from the pointers (needs unified addressing).
MEMCPY_DEFAULT = 4
# cudaMemcpySrcAccessOrder: sources are read in stream order (after earlier work on the stream).
SRC_ACCESS_ORDER_STREAM = 1
# cudaMemLocationType (hints; ignored for device and pinned memory, set for documentation).
LOCATION_DEVICE = 1
LOCATION_HOST = 2
# cudaMemcpyFlags: prefer copy engines that overlap with compute.
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
# cudaDevAttrMaxPitch on every current NVIDIA GPU: a 2D copy refuses a larger pitch.
DEFAULT_MAX_PITCH = 2**31 - 1


@dataclass(frozen=True)
class MemcpyAttributes:
    """`cudaMemcpyAttributes` of one run of copies in a batch."""

    src_access_order: int = SRC_ACCESS_ORDER_STREAM
    src_location: int = LOCATION_DEVICE
    dst_location: int = LOCATION_HOST
    device: int = 0  # the location id when a location is the device
    flags: int = FLAG_PREFER_OVERLAP_WITH_COMPUTE


@dataclass(frozen=True)
class EngineReady:
    """The engine's work a copy must follow.

    `event` was recorded on the engine's stream (vLLM's current stream) after
    that work, e.g. after the forward that wrote the blocks a store reads, or
    after the step's zeroing of blocks a load fills. The copy stream waits on it
    on the GPU: nothing blocks on the host. `None`: engine memory is on the CPU,
    where every copy runs after the engine's work anyway."""

    event: object | None


class CudaRuntime:
    """The runtime calls of the GPU copier. Required: everything but the batched
    copy, an optional hook (`batch_available` False, `memcpy_batch_async` refuses)."""

    #: The largest pitch a 2D copy accepts (cudaDevAttrMaxPitch).
    max_pitch: int = DEFAULT_MAX_PITCH
    #: The copier's device (the location id of device memory in batch attributes).
    device_index: int = 0
    #: The device's streaming multiprocessors (cudaDevAttrMultiProcessorCount); 0: not
    #: known. The copy kernel's grid is at most one thread block per SM (cuda.py).
    multiprocessors: int = 0

    def activate(self) -> contextlib.AbstractContextManager:
        """A context that makes the copier's device current on the calling thread
        (CUDA's current device is per thread; our copy threads start on device 0)."""
        return contextlib.nullcontext()

    # --- streams and events ---

    def current_stream(self) -> object:
        """The stream the calling thread's engine work runs on (vLLM's stream)."""
        raise NotImplementedError

    def new_stream(self) -> object:
        """A new non-blocking stream of the copier's device."""
        raise NotImplementedError

    def new_event(self) -> object:
        """A new event (no timing)."""
        raise NotImplementedError

    def record(self, event: object, stream: object) -> None:
        """`cudaEventRecord`: the event completes when the stream's work so far has."""
        raise NotImplementedError

    def stream_wait_event(self, stream: object, event: object) -> None:
        """`cudaStreamWaitEvent`: later work on `stream` waits for the event's most
        recent record (none: no wait)."""
        raise NotImplementedError

    def query(self, event: object) -> bool:
        """`cudaEventQuery`: whether the event's most recent record has completed."""
        raise NotImplementedError

    def synchronize(self, event: object) -> None:
        """`cudaEventSynchronize`: block the calling thread until the event completes."""
        raise NotImplementedError

    # --- moving bytes ---

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                       height: int, kind: int, stream: object) -> None:
        """`cudaMemcpy2DAsync`: `height` rows of `width` bytes, row r from
        `src + r * spitch` to `dst + r * dpitch`, in stream order."""
        raise NotImplementedError

    @property
    def batch_available(self) -> bool:
        """Whether `memcpy_batch_async` can be called (CUDA 12.8+ driver and bindings)."""
        return False

    def memcpy_batch_async(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                           attrs: Sequence[MemcpyAttributes], attrs_idxs: Sequence[int],
                           stream: object) -> None:
        """`cudaMemcpyBatchAsync`: copy i moves `sizes[i]` bytes from `srcs[i]` to
        `dsts[i]`; `attrs[k]` applies from copy `attrs_idxs[k]` on. Copies of one
        batch run in any order, the batch as a whole in stream order."""
        raise TransferError("this CUDA runtime has no batched memcpy (cudaMemcpyBatchAsync)")

    def compile_kernel(self, source: str, name: str) -> object:
        """Compile `source` (CUDA C++) and return its `extern "C"` kernel `name`."""
        raise NotImplementedError

    def launch(self, kernel: object, grid: int, block: int, args: Sequence[np.generic],
               stream: object) -> None:
        """Launch a 1-D grid of `kernel` on `stream`; `args` are numpy scalars whose
        dtypes are the kernel's parameter types (their values are captured now)."""
        raise NotImplementedError

    # --- host memory ---

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A page-locked uint8 CPU tensor the device can read (descriptor buffers)."""
        raise NotImplementedError

    def check_host_pool(self, pool: torch.Tensor) -> None:
        """Raise TransferError unless the device can address `pool` directly."""
        raise NotImplementedError

    def record_current(self) -> EngineReady:
        """An `EngineReady` recorded now on the calling thread's current stream."""
        event = self.new_event()
        self.record(event, self.current_stream())
        return EngineReady(event)
