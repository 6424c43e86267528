"""NamespacedTier: keeps the layouts (models) apart in a plug-in tier that does not itself.

Bytes stored under one layout fingerprint must never be served to another. The built-in
tiers keep fingerprints apart themselves (a directory, a key prefix per layout namespace).
A plug-in tier chosen by ``storage_tier: "module:Class"`` is opened by
``StorageTier.from_options``' default, which used to call ``cls(**options)`` and drop the
fingerprint: a plug-in shared by two models (a store two engines use) mixed their blocks,
as keys are block hashes that do not name the model. So the default wraps the plug-in in
this class, which prefixes every key with the layout namespace (``record.layout_namespace``:
format version and a hash of the fingerprint) on the way in and strips it on the way out;
keys of other layouts the plug-in lists are not shown. A plug-in that keeps fingerprints apart
itself overrides ``from_options`` (as the built-in tiers do) and is not wrapped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv_offload.backends.base import StorageTier, TierChanges, TierJobResult, TierStats
from kv_offload.backends.record import layout_namespace


class NamespacedTier(StorageTier):
    """``inner`` with every key prefixed by the namespace of ``layout_fingerprint``."""

    def __init__(self, inner: StorageTier, layout_fingerprint: str) -> None:
        self.inner = inner
        self._prefix = layout_namespace(layout_fingerprint).encode() + b"/"

    def _wrap(self, keys: Sequence[bytes]) -> list[bytes]:
        # (bad keys are passed on unchanged: the plug-in's own checks name them)
        return [self._prefix + k if isinstance(k, bytes) and k else k for k in keys]

    def _ours(self, keys: Sequence[bytes]) -> tuple[bytes, ...]:
        n = len(self._prefix)
        return tuple(k[n:] for k in keys if k.startswith(self._prefix))

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.lookup(self._wrap(keys))

    def submit_write(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        return self.inner.submit_write(self._wrap(keys), buffers)

    def submit_read(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        return self.inner.submit_read(self._wrap(keys), buffers)

    def poll(self) -> list[TierJobResult]:
        n = len(self._prefix)
        return [TierJobResult(r.job_id, tuple(k[n:] for k in r.keys), r.succeeded)
                for r in self.inner.poll()]

    def close(self) -> None:
        self.inner.close()

    def take_changes(self, max_keys: int) -> TierChanges:
        changes = self.inner.take_changes(max_keys)
        return TierChanges(self._ours(changes.added), self._ours(changes.removed))

    def find(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.find(self._wrap(keys))

    def keys(self) -> list[bytes] | None:
        held = self.inner.keys()
        return None if held is None else list(self._ours(held))

    def clear(self) -> None:
        """Clears the plug-in: every layout's keys (it has no way to clear one layout)."""
        self.inner.clear()

    def stats(self) -> TierStats:
        return self.inner.stats()

    def describe(self) -> str:
        return self.inner.describe()

    def discard(self, keys: Sequence[bytes]) -> None:
        self.inner.discard(self._wrap(keys))

    def touch(self, keys: Sequence[bytes]) -> None:
        self.inner.touch(self._wrap(keys))

    # The generation record is the plug-in's own: one per plug-in store, not per layout (a
    # reset by one model then starts a new generation for every model sharing the store: a
    # cold cache for the others, never wrong bytes).
    def read_generation(self) -> bytes | None:
        return self.inner.read_generation()

    def write_generation(self, record: bytes) -> bool:
        return self.inner.write_generation(record)

    def create_generation(self, record: bytes) -> bytes | None:
        return self.inner.create_generation(record)
