"""Host buffers as bytes: what every tier does to hand a host slot to its I/O calls.

A tier only ever sees host buffers (1-D uint8/int8 CPU tensors, views into the host pool; see
``kv_offload.backends.base``). Its I/O calls (``preadv`` into a file, a socket's ``recv_into``,
an HTTP body) take a writable buffer of bytes, so the tensor is handed over as a memoryview of
its own memory: no copy, and a read lands straight in the slot.

Contents:
- `host_view`: the writable byte view of a host buffer.
"""

from __future__ import annotations

import torch


def host_view(buf: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous 1-D uint8/int8 CPU tensor (no copy)."""
    return memoryview(buf.numpy()).cast("B")
