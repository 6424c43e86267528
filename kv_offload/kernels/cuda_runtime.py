"""The production CUDA runtime: cupy for memcpy and the kernel, torch for streams and
events (so an event recorded on vLLM's torch stream is one we can wait on), NVIDIA's
cuda-python for the batched memcpy (`cuda_batch.py`).

Imported only when engine memory is on a GPU: cupy is optional (`kv_offload[cuda]`).
Verified on the host through the same copier code driven by a host executor
(tests/helpers/host_cuda.py), and on an NVIDIA H200 (tests/unit/kernels/test_gpu_device.py,
benchmarks/gpu_session.sh).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from kv_offload.errors import TransferError
from kv_offload.kernels.cuda_batch import BatchMemcpy, load_batch_memcpy
from kv_offload.kernels.runtime import DEFAULT_MAX_PITCH, CudaRuntime, MemcpyAttributes

_DEV_ATTR_MAX_PITCH = 11  # cudaDevAttrMaxPitch
_DEV_ATTR_MULTIPROCESSORS = 16  # cudaDevAttrMultiProcessorCount
_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost: page-locked host memory the GPU can reach


class CupyRuntime(CudaRuntime):
    def __init__(self, device: torch.device) -> None:
        import cupy  # optional dependency

        self._cupy = cupy
        self.device = device
        self.device_index = device.index if device.index is not None else \
            torch.cuda.current_device()
        self._batch: BatchMemcpy | None = load_batch_memcpy(self.device_index)
        self._external: dict[int, object] = {}
        try:
            self.max_pitch = cupy.cuda.runtime.deviceGetAttribute(_DEV_ATTR_MAX_PITCH,
                                                                  self.device_index)
        except Exception:  # an older cupy: every current GPU has this value
            self.max_pitch = DEFAULT_MAX_PITCH
        try:
            self.multiprocessors = cupy.cuda.runtime.deviceGetAttribute(
                _DEV_ATTR_MULTIPROCESSORS, self.device_index)
        except Exception:  # not known: the kernel's grid is capped by MAX_GRID alone
            self.multiprocessors = 0

    def activate(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device_index))
        stack.enter_context(self._cupy.cuda.Device(self.device_index))
        return stack

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def stream_wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def query(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                       height: int, kind: int, stream: torch.cuda.Stream) -> None:
        self._cupy.cuda.runtime.memcpy2DAsync(dst, dpitch, src, spitch, width, height, kind,
                                              stream.cuda_stream)

    @property
    def batch_available(self) -> bool:
        return self._batch is not None

    def memcpy_batch_async(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                           attrs: Sequence[MemcpyAttributes], attrs_idxs: Sequence[int],
                           stream: torch.cuda.Stream) -> None:
        if self._batch is None:
            super().memcpy_batch_async(dsts, srcs, sizes, attrs, attrs_idxs, stream)
        self._batch(dsts, srcs, sizes, attrs, attrs_idxs, stream.cuda_stream)

    def compile_kernel(self, source: str, name: str) -> object:
        return self._cupy.RawKernel(source, name)

    def launch(self, kernel, grid: int, block: int, args: Sequence[np.generic],
               stream: torch.cuda.Stream) -> None:
        handle = stream.cuda_stream
        external = self._external.get(handle)
        if external is None:
            external = self._external[handle] = self._cupy.cuda.ExternalStream(handle)
        kernel((grid,), (block,), tuple(args), stream=external)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def check_host_pool(self, pool: torch.Tensor) -> None:
        if pool.device.type != "cpu" or not self.page_locked(pool):
            raise TransferError("the host pool must be pinned CPU memory for GPU copies "
                                f"(got a {pool.device.type} tensor, not page-locked)")

    def page_locked(self, tensor: torch.Tensor) -> bool:
        """Whether the driver knows the tensor's bytes as page-locked host memory. The
        driver is asked, not torch: on an H200 with torch 2.11, `is_pinned()` answered
        False for our pool, page-locked with cudaHostRegister (GPU session, issue 27)."""
        try:
            attributes = self._cupy.cuda.runtime.pointerGetAttributes(tensor.data_ptr())
        except Exception:  # a pointer the driver does not know: not page-locked
            return False
        return int(attributes.type) == _MEMORY_TYPE_HOST
