"""The host-memory (primary) tier: engine blocks <-> pinned or plain host slots."""

from kv_offload.store.host.pool import allocate_pool
from kv_offload.store.host.tier import HostTier

__all__ = ["HostTier", "allocate_pool"]
