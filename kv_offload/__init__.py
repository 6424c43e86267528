"""kv-offload: offload the KV cache of LLM serving engines to host memory and disk."""

# The one place the version is written: pyproject.toml reads it (setuptools' `attr:`, parsed
# without importing torch), `kv-offload --version` and every JSON envelope print it.
__version__ = "0.1.0"

from kv_offload import builtin_rules as _builtin_rules  # noqa: F401  (registers built-in specs)
from kv_offload.canonical import CanonicalKVCaches, CanonicalRef, CanonicalTensor, canonicalize
from kv_offload.errors import (
    CanonicalizationError,
    ConfigError,
    KVOffloadError,
    RegistryError,
    SpecError,
    SpecMergeError,
    UnregisteredSpecError,
)
from kv_offload.hits import CacheHit, find_longest_cache_hit
from kv_offload.registry import KVCacheSpecRegistry, default_registry, register_kv_cache_spec
from kv_offload.runtime import moved as _moved
from kv_offload.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

_moved.install()  # (old import paths of moved modules, for one release)

__all__ = [
    "__version__",
    "AttentionSpec",
    "CacheHit",
    "CanonicalKVCaches",
    "CanonicalRef",
    "CanonicalTensor",
    "CanonicalizationError",
    "ChunkedLocalAttentionSpec",
    "ConfigError",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "KVCacheGroup",
    "KVCacheSpec",
    "KVCacheSpecRegistry",
    "KVOffloadError",
    "MLAAttentionSpec",
    "MambaSpec",
    "RegistryError",
    "SinkFullAttentionSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "SpecError",
    "SpecMergeError",
    "UniformTypeKVCacheSpecs",
    "UnregisteredSpecError",
    "canonicalize",
    "default_registry",
    "find_longest_cache_hit",
    "register_kv_cache_spec",
]
