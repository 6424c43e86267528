"""A complete third-party storage tier: keys in a dict, in process memory.

It exists to show how small a tier can be: the five methods of ``StorageTier``, the shared
argument checks, and per-key success reporting. It passes the same contract suite as the
built-in tiers (tests/unit/backends/test_tier_suite.py). Jobs complete synchronously;
results wait for ``poll``. Choose it with
``"storage_tier": "kv_offload.backends.example:DictTier"`` and
``"storage_options": {"max_bytes": ...}``: the options are the constructor's keyword
arguments (``StorageTier.from_options``' default, which also wraps it in a
``NamespacedTier`` so that two models sharing it never mix), checked at start-up.

Optional hooks it implements: ``discard`` (drop values the layer above found unverifiable)
and the generation record (kept in memory: this tier forgets everything at exit anyway).
With ``secret_file`` it stores sealed records without knowing it (``SealedTier``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import torch

from kv_offload.backends.base import StorageTier, TierJobResult, check_tier_keys, check_tier_request
from kv_offload.errors import TierClosedError


class DictTier(StorageTier):
    """Stores a private copy of each written buffer; evicts the oldest key past ``max_bytes``."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._data: dict[bytes, torch.Tensor] = {}  # insertion order = eviction order
        self._results: list[TierJobResult] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._generation: bytes | None = None

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        check_tier_keys(keys)
        with self._lock:
            return [key in self._data for key in keys]

    def submit_write(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        return self._run(keys, buffers, self._store)

    def submit_read(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        return self._run(keys, buffers, self._load)

    def poll(self) -> list[TierJobResult]:
        with self._lock:
            done, self._results = self._results, []
            return done

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def discard(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._data.pop(key, None)

    def read_generation(self) -> bytes | None:
        return self._generation

    def write_generation(self, record: bytes) -> bool:
        self._generation = bytes(record)
        return True

    def create_generation(self, record: bytes) -> bytes | None:
        with self._lock:  # (the check and the write as one: starters agree on one record)
            if self._generation is None:
                self._generation = bytes(record)
            return self._generation

    def _store(self, key: bytes, buf: torch.Tensor) -> bool:
        if buf.numel() > self.max_bytes:
            return False
        self._data.pop(key, None)
        used = sum(t.numel() for t in self._data.values())
        while self._data and used + buf.numel() > self.max_bytes:
            used -= self._data.pop(next(iter(self._data))).numel()
        self._data[key] = buf.view(torch.uint8).clone()
        return True

    def _load(self, key: bytes, buf: torch.Tensor) -> bool:
        stored = self._data.get(key)
        if stored is None or stored.numel() != buf.numel():
            return False
        buf.view(torch.uint8).copy_(stored)
        return True

    def _run(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor], one_key) -> int:
        check_tier_request(keys, buffers)
        with self._lock:
            if self._closed:
                raise TierClosedError("this DictTier is closed; submit jobs before close()")
            ok = tuple(one_key(key, buf) for key, buf in zip(keys, buffers))
            job_id = next(self._ids)
            self._results.append(TierJobResult(job_id, tuple(keys), ok))
            return job_id
