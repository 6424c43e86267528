"""The host-memory pool: `num_slots` slots of `slot_bytes`, sized from a byte budget."""

from __future__ import annotations

import weakref

import torch

from kv_offload.errors import ConfigError
from kv_offload.kernels.geometry import HostSlotLayout
from kv_offload.kernels.runtime import CudaRuntime

PAGE_BYTES = 4096  # O_DIRECT alignment


def cuda_present() -> bool:
    """Whether pinned memory is worth having (and possible)."""
    return torch.cuda.is_available()


def allocate_pool(layout: HostSlotLayout, cpu_bytes_to_use: int,
                  pin: bool | None = None, runtime: CudaRuntime | None = None) -> torch.Tensor:
    """An int8 `(num_slots, slot_bytes)` tensor using at most `cpu_bytes_to_use` bytes.

    Pinned (page-locked, so the GPU can DMA it and kernels can address it)
    when CUDA is present, unless `pin` says otherwise; plain memory otherwise.
    The memory is not touched here: the OS commits pages on first write. The pool
    starts on a page boundary (pinned memory always does) so the disk tier can read
    and write slots with O_DIRECT. A given CUDA `runtime` allocates the pinned memory
    (the tests' host executor stands in for the GPU that way)."""
    if isinstance(cpu_bytes_to_use, bool) or not isinstance(cpu_bytes_to_use, int):
        raise ConfigError(f"cpu_bytes_to_use must be an int (bytes), got {cpu_bytes_to_use!r}")
    if layout.slot_bytes <= 0:
        raise ConfigError("the KV cache has no bytes to offload (every group is empty)")
    num_slots = cpu_bytes_to_use // layout.slot_bytes
    if num_slots < 1:
        raise ConfigError(
            f"cpu_bytes_to_use={cpu_bytes_to_use} is smaller than one host slot "
            f"({layout.slot_bytes} bytes = one block of the largest cache group); "
            f"expected at least {layout.slot_bytes}"
        )
    if runtime is not None:
        return runtime.pinned_empty(num_slots * layout.slot_bytes).view(torch.int8).view(
            num_slots, layout.slot_bytes)
    pin = cuda_present() if pin is None else pin
    if pin and not cuda_present():
        raise ConfigError("pinned host memory was asked for, but CUDA is not available")
    nbytes = num_slots * layout.slot_bytes
    raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.int8)
    shift = (-raw.data_ptr()) % PAGE_BYTES
    pool = raw[shift:shift + nbytes].view(num_slots, layout.slot_bytes)
    if pin:
        # Page-lock exactly these bytes. torch's pinned allocator (`pin_memory=True`) rounds
        # each request up to a power of two: 20 GiB would lock 32 GiB of the machine.
        register_pinned(pool)
    return pool


def register_pinned(pool: torch.Tensor) -> None:
    """Page-lock `pool`'s bytes with `cudaHostRegister`, until `release_pinned(pool)` or
    until the pool tensor is collected, whichever comes first."""
    cudart = torch.cuda.cudart()
    nbytes = pool.numel() * pool.element_size()
    status = cudart.cudaHostRegister(pool.data_ptr(), nbytes, 0)
    if int(status) != 0:
        raise ConfigError(f"cannot page-lock {nbytes} bytes of host memory for the host tier "
                          f"(cudaHostRegister returned {int(status)}); lower cpu_bytes_to_use "
                          f"or raise the memlock limit (ulimit -l)")
    release = weakref.finalize(pool, _unregister, pool.data_ptr())
    release.atexit = False  # at exit the driver drops the process's registrations itself
    _registered[pool.data_ptr()] = release


def release_pinned(pool: torch.Tensor) -> None:
    """Undo `register_pinned` now: the backend closed, no copy uses the pool any more.
    A range left registered after its memory is freed makes the next registration that
    overlaps it fail (cudaErrorHostMemoryAlreadyRegistered: seen on an H200, where the
    second backend of a process could not pin its pool)."""
    release = _registered.get(pool.data_ptr())
    if release is not None:
        release()


_registered: dict[int, weakref.finalize] = {}  # pool address -> its unregistration


def _unregister(address: int) -> None:
    _registered.pop(address, None)
    torch.cuda.cudart().cudaHostUnregister(address)
