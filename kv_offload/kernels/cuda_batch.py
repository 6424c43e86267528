"""`cudaMemcpyBatchAsync` through NVIDIA's cuda-python bindings, resolved lazily.

CUDA 12.8 added one call for many copies (about 0.5 us per copy, against 5-7 us per
`cudaMemcpyAsync` call). cupy does not expose it; NVIDIA's `cuda-bindings` package
does, as `cuda.bindings.runtime.cudaMemcpyBatchAsync`. Importing the bindings needs
no GPU or driver; the call needs a 12.8+ driver, so `load_batch_memcpy` checks the
driver's version and answers None (the copier then uses 2D copies and its kernel)
when the bindings are missing or the driver is older. A call that fails anyway
(e.g. bindings built for a newer driver) raises `CudaCallError`; the copier then
falls back for good.

Binding facts (cuda-bindings 12.9 and 13.x): the Python signature is
`(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)` with lists of ints
and `cudaMemcpyAttributes`; 12.x returns `(err, failIdx)`, 13.x returns `(err,)`;
the stream must not be the legacy NULL stream.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np

from kv_offload.errors import CudaCallError
from kv_offload.kernels.runtime import MemcpyAttributes

logger = logging.getLogger(__name__)

MIN_DRIVER_VERSION = 12080  # CUDA 12.8: the first driver with the batched memcpy


def load_batch_memcpy(device_index: int) -> BatchMemcpy | None:
    """The batched memcpy for this process, or None where it cannot run."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        logger.info("kv-offload: cuda-bindings is not installed; no batched memcpy "
                    "(pip install cuda-bindings)")
        return None
    # Bindings older than 12.8 do not have the function at all.
    if getattr(cudart, "cudaMemcpyBatchAsync", None) is None:
        logger.info("kv-offload: cuda-bindings %s predates cudaMemcpyBatchAsync", cudart)
        return None
    err, version = cudart.cudaDriverGetVersion()[:2]
    if err != cudart.cudaError_t.cudaSuccess or version < MIN_DRIVER_VERSION:
        logger.info("kv-offload: CUDA driver version %s < %d: no batched memcpy", version,
                    MIN_DRIVER_VERSION)
        return None
    return BatchMemcpy(cudart, device_index)


class BatchMemcpy:
    """Calls `cudaMemcpyBatchAsync` with our arrays and attributes."""

    def __init__(self, cudart, device_index: int) -> None:
        self._rt = cudart
        self._device = device_index
        self._thread = threading.local()  # the current device is per thread
        self._attrs: dict[MemcpyAttributes, object] = {}

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                 attrs: Sequence[MemcpyAttributes], attrs_idxs: Sequence[int],
                 stream_handle: int) -> None:
        rt = self._rt
        if not getattr(self._thread, "bound", False):
            check(rt, rt.cudaSetDevice(self._device), "cudaSetDevice")
            self._thread.bound = True
        result = rt.cudaMemcpyBatchAsync(
            dsts.tolist(), srcs.tolist(), sizes.tolist(), int(sizes.size),
            [self._attributes(a) for a in attrs], [int(i) for i in attrs_idxs], len(attrs),
            rt.cudaStream_t(stream_handle))
        check(rt, result, "cudaMemcpyBatchAsync")

    def _attributes(self, attrs: MemcpyAttributes) -> object:
        made = self._attrs.get(attrs)
        if made is None:
            rt = self._rt
            made = rt.cudaMemcpyAttributes()
            made.srcAccessOrder = rt.cudaMemcpySrcAccessOrder(attrs.src_access_order)
            made.srcLocHint.type = rt.cudaMemLocationType(attrs.src_location)
            made.srcLocHint.id = attrs.device
            made.dstLocHint.type = rt.cudaMemLocationType(attrs.dst_location)
            made.dstLocHint.id = attrs.device
            made.flags = attrs.flags
            self._attrs[attrs] = made
        return made


def check(cudart, result: tuple, call: str) -> None:
    """Raise CudaCallError naming the call and the runtime's error, if any."""
    err = result[0]
    if err == cudart.cudaError_t.cudaSuccess:
        return
    name = cudart.cudaGetErrorName(err)[1]
    text = cudart.cudaGetErrorString(err)[1]
    raise CudaCallError(f"{call} failed: {_text(name)}: {_text(text)}")


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
