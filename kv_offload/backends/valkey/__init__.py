"""The Valkey/Redis tier: one KV store shared by many servers (`storage_tier: "valkey"`).

Needs redis-py (``pip install 'kv-offload[valkey]'``, which brings the hiredis parser too).
"""

from kv_offload.backends.valkey.config import ValkeyTierConfig
from kv_offload.backends.valkey.tier import ValkeyTier

__all__ = ["ValkeyTier", "ValkeyTierConfig"]
