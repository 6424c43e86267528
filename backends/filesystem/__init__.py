"""The filesystem tier: one checksummed safetensors file per key, shared and persistent."""

from kv_offload.backends.filesystem.io_engine import aligned_host_buffer
from kv_offload.backends.filesystem.tier import (
    FilesystemTier,
    FilesystemTierConfig,
    FilesystemTierStats,
)

__all__ = ["FilesystemTier", "FilesystemTierConfig", "FilesystemTierStats", "aligned_host_buffer"]
