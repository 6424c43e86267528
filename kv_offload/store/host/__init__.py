"""The host-memory (primary) tier: engine blocks <-> pinned or plain host slots."""

from kv_offload.store.host.backend import CpuBackend
from kv_offload.store.host.pool import allocate_pool

__all__ = ["CpuBackend", "allocate_pool"]
