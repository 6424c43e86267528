"""The filesystem tier: one checksummed safetensors file per key, shared and persistent."""

from kv_offload.backends.filesystem.config import FilesystemTierConfig, FilesystemTierStats
from kv_offload.backends.filesystem.io_engine import aligned_host_buffer
from kv_offload.backends.filesystem.tier import FilesystemTier

__all__ = ["FilesystemTier", "FilesystemTierConfig", "FilesystemTierStats", "aligned_host_buffer"]
