"""The typed errors of kv-offload. Each message names what was wrong and what was expected."""


class KVOffloadError(Exception):
    """Base class of every error this library raises on bad input."""


class SpecError(KVOffloadError, ValueError):
    """A KV-cache spec with impossible values (e.g. padding smaller than the page)."""


class SpecMergeError(SpecError):
    """Layers of one cache group whose specs disagree."""


class RegistryError(KVOffloadError, ValueError):
    """A registration that conflicts with an earlier one or is malformed."""


class UnregisteredSpecError(RegistryError, LookupError):
    """A spec type (and no base class of it) has rules in the registry."""


class CanonicalizationError(KVOffloadError, ValueError):
    """An engine cache layout that cannot be proven to map onto canonical pages."""


class ConfigError(KVOffloadError, ValueError):
    """A bad configuration key, type or value."""


class TierRequestError(KVOffloadError, ValueError):
    """Keys or host buffers handed to a storage tier that break its contract."""


class TierClosedError(KVOffloadError, RuntimeError):
    """A job submitted to a storage tier after it was closed."""


class TierRootError(KVOffloadError, OSError):
    """A storage tier root directory that cannot be used (not a directory, not writable...)."""


class HitLookupError(KVOffloadError, ValueError):
    """Bad input to a cache-hit lookup, or a hit rule that answered out of range."""


class OffloadStateError(KVOffloadError, RuntimeError):
    """An offload-manager call that does not fit a key's state (e.g. completing
    a load that was never prepared, or completing a store twice)."""


class EvictionPolicyError(ConfigError):
    """An unknown eviction policy name, a bad import path, or a policy that
    broke its contract."""


class TransferError(KVOffloadError, ValueError):
    """A copy request with bad block or slot ids, or for a backend that cannot take it."""


class CudaCallError(KVOffloadError, RuntimeError):
    """A CUDA runtime call made by the copier failed (the job fails; the engine recomputes)."""


class ServingError(KVOffloadError, RuntimeError):
    """A vLLM server that did not answer as its OpenAI-compatible API and vLLM's own
    endpoints (/health, /tokenize, /metrics, /reset_prefix_cache) document."""


class ServerStartError(ServingError):
    """A vLLM server subprocess that exited, or never became healthy, while starting."""


class ServeCheckInputError(KVOffloadError, ValueError):
    """Arguments of `kv-offload serve-check` that cannot work against this server, or a
    `--replay` record that is not one `--record` wrote."""


class BenchArgumentError(KVOffloadError, ValueError):
    """Flags of `kv-offload bench` that the chosen backend cannot honour, or bad values."""


class ProxyDependencyError(ServingError):
    """`kv-offload proxy` started where starlette, uvicorn or httpx is not installed."""
