"""The interface of secondary storage tiers (disk, object stores, remote memory...).

Contents:
- `StorageTier`: five required methods (lookup, submit_write, submit_read, poll, close),
  optional hooks with working defaults (take_changes, find, keys, clear, stats, discard,
  read_generation, write_generation, create_generation, submit_write_repacked,
  submit_read_repacked): callers
  never probe,
  and two classmethods that build a tier from the connector config (check_options,
  from_options; by default the options are the constructor's keyword arguments).
  The class attribute `shared` says whether others can write where the tier stores (a
  server or a bucket, as valkey and s3: True): a shared tier starts only with
  `secret_file` or the explicit opt-out `trusted_store` (`startup_checks.check_config`).
  Default False: a store private to this host and user, as the filesystem tier's 0700
  directory.
- `TierJobResult`, `TierChanges`, `TierStats`: what a tier hands back.
- `Repack`: a value stored in another byte order than its host buffer's (a TP-free record
  read by a rank of another TP size or page layout): a tier that takes them packs and
  unpacks on its I/O threads.
- `check_tier_keys`, `check_tier_request`: the argument checks every tier shares;
  `value_bytes`: the size of a buffer or `Repack`;
  `check_constructor_options`: the default check of `storage_options`.

Built-in tiers are registered by name in `kv_offload.backends` and imported lazily.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_offload.errors import ConfigError, TierRequestError

# Secondary tiers
#
# A secondary tier (disk, object store, remote memory...) sits behind the host-memory tier and
# only ever sees host buffers: 1-D uint8/int8 CPU tensors that are views into the host pool.
# It never touches engine tensors or the GPU. Keys are opaque bytes chosen by the caller; the
# same key always names the same bytes (keys are derived from content hashes), so a tier may
# skip rewriting a key it already holds.

HOST_BUFFER_DTYPES = (torch.uint8, torch.int8)


@dataclass(frozen=True)
class TierJobResult:
    """The outcome of one tier job: one success flag per key, in submission order."""

    job_id: int
    keys: tuple[bytes, ...]
    succeeded: tuple[bool, ...]

    @property
    def ok(self) -> bool:
        """True when every key of the job succeeded."""
        return all(self.succeeded)

    @property
    def failed_keys(self) -> tuple[bytes, ...]:
        """The keys that failed (a read left their buffer undefined; a write stored nothing)."""
        return tuple(k for k, ok in zip(self.keys, self.succeeded) if not ok)


class Repack(ABC):
    """A value whose stored bytes (`nbytes`) are a rearrangement of part of a host buffer
    (`tp.tier`: a KV-head record that is not the host slot's bytes). A tier that takes repacked
    values moves the stored bytes through a buffer of its own, reused across keys (the
    filesystem tier: one per I/O thread), and calls `pack` before writing and `unpack`
    after a verified read on the thread that does the key's I/O: the copies run beside
    other keys' I/O, and no buffer is allocated per key. Both may run on several threads
    at once (for different values)."""

    nbytes: int

    @abstractmethod
    def pack(self, out: torch.Tensor) -> None:
        """Fill `out` (`nbytes`, int8/uint8) with the bytes to store."""

    @abstractmethod
    def unpack(self, stored: torch.Tensor) -> None:
        """Copy verified stored bytes (`nbytes`, int8/uint8) into the host buffer."""


def value_bytes(value: torch.Tensor | Repack) -> int:
    """How many bytes a value of a (repacked) request stores."""
    return value.nbytes if isinstance(value, Repack) else value.numel()


@dataclass(frozen=True)
class TierChanges:
    """Keys that became readable (`added`) or stopped being readable (`removed`) since the
    previous `take_changes`: own writes, evictions, bad files dropped, and what a rescan
    found other processes did. The latest state of a key wins: a key never appears in both."""

    added: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()

    def __len__(self) -> int:
        return len(self.added) + len(self.removed)


@dataclass(frozen=True)
class TierStats:
    """A snapshot of what a tier holds, and counters of what it did (by name). One count is
    read by the connector: ``servers_down``, how many of the tier's servers do not answer
    now (the ``vllm:kv_offload_tier_servers_down`` gauge); a tier with servers sets it."""

    keys: int = 0
    bytes_used: int = 0
    bytes_budget: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    def __getitem__(self, name: str) -> int:
        """A counter by name (0 if it never happened), e.g. ``stats["write_failed"]``."""
        return self.counts.get(name, 0)

    def __contains__(self, name: object) -> bool:
        """Whether the tier counted ``name`` at all. (Without it, ``in`` would probe
        ``stats[0]``, ``stats[1]``... for ever: every missing name reads as 0.)"""
        return name in self.counts


class StorageTier(ABC):
    """A secondary tier that stores host buffers under opaque byte keys.

    Contract for implementers:
    - ``lookup`` answers from memory, never blocks on I/O: the scheduler calls it every step.
    - ``submit_write`` / ``submit_read`` return a job id at once and do the work in the
      background (or synchronously, for a tier that is fast enough). The caller keeps the
      buffers alive and untouched until that job id comes back from ``poll``.
    - Faults (missing, corrupt or foreign data, full or read-only storage) never raise: the key
      is reported as failed in the job's ``TierJobResult``. Only bad arguments raise, as
      ``TierRequestError`` (see ``check_tier_request``), and use after ``close`` raises
      ``TierClosedError``.
    - A read fills the caller's buffer in place; a key stored with a different size fails.
    - ``shared``: set it to True in a tier that stores where others can write (a server, a
      bucket): without ``secret_file`` anyone who can write there decides what engines
      serve, so such a tier starts only with ``secret_file`` or ``trusted_store: true``.
    """

    shared: bool = False

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored. A hint: a later read may still fail (evicted, corrupt)."""

    @abstractmethod
    def submit_write(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        """Start storing ``buffers[i]`` under ``keys[i]``; return the job id."""

    @abstractmethod
    def submit_read(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        """Start filling ``buffers[i]`` with the bytes stored under ``keys[i]``; return job id."""

    @abstractmethod
    def poll(self) -> list[TierJobResult]:
        """Return the jobs finished since the last call, each exactly once. Never blocks."""

    @abstractmethod
    def close(self) -> None:
        """Wait for in-flight jobs (their results stay pollable) and release resources.

        Idempotent; submitting after close raises ``TierClosedError``.
        """

    # -- optional hooks: the defaults below are correct for a tier that does nothing more --

    def take_changes(self, max_keys: int) -> TierChanges:
        """Keys added or removed since the last call, at most ``max_keys`` of them (the rest
        wait for the next call). The first calls list every key the tier already holds (e.g.
        files from before a restart), in chunks. Must not block on I/O: the caller runs it
        on every engine step. Default: nothing; the caller then knows only the keys it
        wrote itself and learns of evictions when a read fails."""
        return TierChanges()

    def find(self, keys: Sequence[bytes]) -> list[bool]:
        """Ask the store itself, not this tier's view, whether it holds ``keys`` now, and
        adopt those it holds into the view: ``lookup`` then answers True for them and
        ``take_changes`` reports them as added, exactly like keys a refresh found. For keys
        another server stored moments ago (a decode server waiting for the blocks its
        prefill server just stored), which the background refresh has not brought yet: a
        question proportional to the request, not to the store.
        Bounded I/O: at most the tier's request deadline per call, batched where the store
        allows; called from the worker's own thread, never on the engine's step path, with
        at most a few hundred keys. Keys the store could not be asked about (an outage) are
        answered from the view; a store's fault never raises. A key the view holds and the
        store no longer does is answered False but left in the view (a read that misses, or
        the next refresh, drops it). Default: ``lookup(keys)`` (the view only: right for a
        tier without a cheaper targeted question, e.g. one whose view is the store)."""
        return self.lookup(keys)

    def keys(self) -> list[bytes] | None:
        """Every key held now, from memory (tools, tests). None: the tier cannot list."""
        return None

    def clear(self) -> None:  # noqa: B027 (an optional hook, not an abstract method)
        """Remove every key (tools, tests). Default: nothing to remove."""

    def stats(self) -> TierStats:
        """What the tier holds and counters of what it did. Default: nothing known."""
        return TierStats()

    def describe(self) -> str:
        """One line for the start-up log: where the tier keeps its data and its budget,
        never a secret. Default: the class name."""
        return type(self).__name__

    def discard(self, keys: Sequence[bytes]) -> None:  # noqa: B027 (optional hook)
        """Delete the values of ``keys``: the layer above found them unverifiable (forged,
        damaged). Default: nothing, right for a tier whose writes overwrite a key it holds;
        a tier that skips keys it already holds must delete here, or a bad value stays a
        miss for good (never served: it fails verification at every read)."""

    def touch(self, keys: Sequence[bytes]) -> None:  # noqa: B027 (optional hook)
        """A lookup found ``keys`` part of a hit it can serve (in order: the last is the
        most valuable, a prefix's first block): a tier that evicts by its own order should
        keep them before keys stored once and never asked for again. From memory only, never
        I/O, on the engine's step path; keys not held are ignored. Default: nothing (right
        for a tier whose server evicts by its own policy, e.g. Valkey's ``maxmemory-policy``)."""

    def read_generation(self) -> bytes | None:
        """The generation record last written with ``write_generation`` by any process
        sharing this tier (opaque bytes: the caller seals and checks them), or None. Called
        once at start-up; may do bounded I/O. Default: None (this tier keeps none)."""
        return None

    def write_generation(self, record: bytes) -> bool:
        """Replace the generation record (overwrite: never skip because one is there),
        where every process opening this tier with the same fingerprint reads it. Called
        on a connector reset. False: this tier cannot keep one (the default; then a reset
        lasts until the process ends: after a restart, keys stored before it are served
        again, which the caller warns about)."""
        return False

    def create_generation(self, record: bytes) -> bytes | None:
        """Store ``record`` as the generation record only if there is none, and return the
        record the tier holds afterwards: ``record`` itself, or the one another process
        stored first (engines starting together must agree on one). None: this tier keeps
        no record. Raises when the store cannot be reached (the caller starts a fresh
        generation and asks again later). Called at start-up when `read_generation` found
        none; may do bounded I/O.
        Default: `write_generation` (not atomic: two processes starting at the same moment
        may each keep their own until the next restart; a tier with a conditional write
        should override)."""
        return record if self.write_generation(record) else None

    def submit_write_repacked(self, keys: Sequence[bytes],
                              values: Sequence[torch.Tensor | Repack]) -> int | None:
        """As `submit_write`, where a value may be a `Repack` that the tier packs into a
        buffer of its own when it writes the key. None (the default): this tier takes
        buffers only; the caller packs into buffers and calls `submit_write`."""
        return None

    def submit_read_repacked(self, keys: Sequence[bytes],
                             values: Sequence[torch.Tensor | Repack]) -> int | None:
        """As `submit_read`, where a value may be a `Repack` that the tier reads into a
        buffer of its own and unpacks once the bytes are verified (a failed key may have
        unpacked nothing, or part). None (the default): as `submit_write_repacked`."""
        return None

    # -- construction from the connector config (`storage_tier`, `storage_options`) --

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Raise ``ConfigError`` naming any bad ``storage_options``, without connecting to or
        touching the storage: it runs at start-up in every process, the scheduler's too.
        Default: the options must be keyword arguments of the constructor."""
        check_constructor_options(cls, options)

    @classmethod
    def from_options(cls, options: Mapping[str, Any], layout_fingerprint: str) -> StorageTier:
        """Open the tier with its ``storage_options``. Bytes stored under one layout
        fingerprint must never be served to another. Default: ``cls(**options)`` wrapped in
        a ``NamespacedTier``, which prefixes every key with the fingerprint's namespace, so
        two models sharing a plug-in never mix. A tier that keeps fingerprints apart itself
        (a directory or key prefix per layout, as the built-in ones) overrides this."""
        from kv_offload.backends.namespaced import NamespacedTier  # (it subclasses this)

        return NamespacedTier(cls(**options), layout_fingerprint)


def check_constructor_options(cls: type, options: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` unless ``options`` are keyword arguments ``cls(...)`` accepts."""
    if not isinstance(options, Mapping):
        raise ConfigError(f"storage_options of {cls.__qualname__} must be a dict, got "
                          f"{type(options).__name__}")
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(str(k) for k in options if k not in named)
    if unknown and not takes_any:
        raise ConfigError(f"unknown storage_options {unknown} for {cls.__qualname__}; "
                          f"accepted: {named}")
    missing = [n for n in named if params[n].default is inspect.Parameter.empty
               and n not in options]
    if missing:
        raise ConfigError(f"storage_options {missing} are required by {cls.__qualname__}")


def check_tier_keys(keys: Sequence[bytes], *, max_key_bytes: int | None = None) -> None:
    """Raise ``TierRequestError`` unless every key is non-empty ``bytes`` (of bounded length)."""
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or not key:
            raise TierRequestError(f"key {i} must be non-empty bytes, got {key!r}")
        if max_key_bytes is not None and len(key) > max_key_bytes:
            raise TierRequestError(
                f"key {i} ({key.hex()}) is {len(key)} bytes; this tier accepts at most "
                f"{max_key_bytes}"
            )


def check_tier_request(
    keys: Sequence[bytes],
    buffers: Sequence[torch.Tensor | Repack],
    *,
    max_key_bytes: int | None = None,
    repacks: bool = False,
) -> None:
    """Raise ``TierRequestError`` unless keys and buffers form a valid tier request.

    Valid: as many buffers as keys, no key twice, every buffer a non-empty contiguous 1-D
    uint8/int8 CPU tensor (or, with ``repacks``, a `Repack` of at least one byte).
    """
    if len(keys) != len(buffers):
        raise TierRequestError(
            f"got {len(keys)} keys but {len(buffers)} buffers; expected one buffer per key"
        )
    check_tier_keys(keys, max_key_bytes=max_key_bytes)
    if len(set(keys)) != len(keys):
        seen: set[bytes] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise TierRequestError(f"key {dup.hex()} appears twice in one request")
    for key, buf in zip(keys, buffers):
        if repacks and isinstance(buf, Repack):
            if buf.nbytes <= 0:
                raise TierRequestError(f"value for key {key.hex()} repacks {buf.nbytes} "
                                       f"bytes; expected at least one")
            continue
        problem = _host_buffer_problem(buf)
        if problem:
            raise TierRequestError(
                f"buffer for key {key.hex()}: {problem}; expected a non-empty contiguous 1-D "
                f"uint8/int8 CPU tensor"
            )


def _host_buffer_problem(buf: object) -> str | None:
    if not isinstance(buf, torch.Tensor):
        return f"got {type(buf).__name__}"
    if buf.device.type != "cpu":
        return f"device is {buf.device}"
    if buf.dtype not in HOST_BUFFER_DTYPES:
        return f"dtype is {buf.dtype}"
    if buf.dim() != 1:
        return f"shape is {tuple(buf.shape)}"
    if buf.numel() == 0:
        return "it is empty"
    if not buf.is_contiguous():
        return f"it is not contiguous (stride {buf.stride()})"
    return None
