"""SealedTier: with ``secret_file``, a plug-in tier only ever stores and returns sealed records.

Where authentication lives, and why here: the built-in tiers (filesystem, Valkey, S3) write
records (``kv_offload.backends.record``) themselves and get the keyed codec directly, so the
tag or the ciphertext travels in the header and data they already write, at no extra copy.
A plug-in tier (``storage_tier: "module:Class"``) stores whatever buffers it is handed, and
nothing it declares or overrides can change that: when a secret is configured,
``make_storage_tier`` wraps every tier that is not a built-in one in this class, so the
plug-in receives whole sealed records (header + data, or ciphertext) in place of the host
buffers and hands back bytes that are verified here before one byte reaches a host buffer.
A plug-in cannot opt out: it is never given plaintext host buffers to fill, and the decision
is taken by the tiering layer from the configured tier name, not by the plug-in.

Cost: one copy per value each way (the record is built in a buffer of its own; a read lands
in one and is copied out after verification), and the plug-in stores ``data_offset`` more
bytes per value (a few hundred). The plug-in also gets a fingerprint of its own
(``codec.tier_fingerprint``), so one that keeps layouts apart keeps sealed records apart too.

A record that fails verification is a miss, counted as ``rejected_records``, logged once per
episode, and handed to the plug-in's ``discard`` hook (its default does nothing: a plug-in
that skips writing keys it holds should implement it, or a planted value stays a miss).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import torch

from kv_offload.backends.base import (
    StorageTier,
    TierChanges,
    TierJobResult,
    TierStats,
    check_tier_request,
)
from kv_offload.backends.common.host_buffers import host_view
from kv_offload.backends.common.rejections import Rejections
from kv_offload.backends.record import (
    NETWORK_ALIGN,
    RecordCodec,
    data_offset,
    pack_into,
    unpack_into,
)
from kv_offload.runtime.faults import FaultLog


@dataclasses.dataclass
class _Read:
    keys: tuple[bytes, ...]
    records: list[torch.Tensor]  # what the plug-in fills
    buffers: list[torch.Tensor]  # the caller's host buffers


class SealedTier(StorageTier):
    """``inner`` behind the record layer of ``codec`` (see the module docstring)."""

    def __init__(self, inner: StorageTier, codec: RecordCodec, fingerprint: str) -> None:
        self.inner = inner
        self.codec = codec
        self.fingerprint = fingerprint
        self._lock = threading.Lock()
        self._reads: dict[int, _Read] = {}
        self._writes: dict[int, list[torch.Tensor]] = {}  # records kept alive until polled
        self._rejected = 0
        self._rejections = Rejections(f"kv-offload {type(inner).__qualname__}")
        self._faults = FaultLog(f"kv-offload {type(inner).__qualname__}")

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.lookup(keys)

    def submit_write(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        check_tier_request(keys, buffers)
        records = []
        for key, buf in zip(keys, buffers):
            record = self._record_buffer(key, buf.numel())
            pack_into(key, self.fingerprint, host_view(buf), host_view(record),
                      align=NETWORK_ALIGN, codec=self.codec)
            records.append(record)
        job_id = self.inner.submit_write(keys, records)
        with self._lock:
            self._writes[job_id] = records
        return job_id

    def submit_read(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        check_tier_request(keys, buffers)
        records = [self._record_buffer(key, buf.numel()) for key, buf in zip(keys, buffers)]
        job_id = self.inner.submit_read(keys, records)
        with self._lock:
            self._reads[job_id] = _Read(tuple(keys), records, list(buffers))
        return job_id

    def poll(self) -> list[TierJobResult]:
        results = []
        for result in self.inner.poll():
            with self._lock:
                self._writes.pop(result.job_id, None)
                read = self._reads.pop(result.job_id, None)
            if read is not None:
                result = TierJobResult(result.job_id, result.keys, tuple(
                    ok and self._verified(key, record, buf)
                    for key, ok, record, buf in zip(read.keys, result.succeeded, read.records,
                                                    read.buffers)))
            results.append(result)
        return results

    def close(self) -> None:
        self.inner.close()

    # -- optional hooks: the plug-in's, around its sealed records --

    def take_changes(self, max_keys: int) -> TierChanges:
        return self.inner.take_changes(max_keys)

    def find(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.find(keys)  # (presence: no record to verify until it is read)

    def keys(self) -> list[bytes] | None:
        return self.inner.keys()

    def clear(self) -> None:
        self.inner.clear()

    def stats(self) -> TierStats:
        stats = self.inner.stats()
        with self._lock:
            rejected = self._rejected
        counts = dict(stats.counts)
        counts["rejected_records"] = counts.get("rejected_records", 0) + rejected
        return dataclasses.replace(stats, counts=counts)

    def describe(self) -> str:
        return self.inner.describe()

    def discard(self, keys: Sequence[bytes]) -> None:
        self.inner.discard(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        self.inner.touch(keys)

    def read_generation(self) -> bytes | None:
        return self.inner.read_generation()

    def write_generation(self, record: bytes) -> bool:
        return self.inner.write_generation(record)

    def create_generation(self, record: bytes) -> bytes | None:
        return self.inner.create_generation(record)

    # -- internals --

    def _record_buffer(self, key: bytes, data_len: int) -> torch.Tensor:
        size = data_offset(key, self.fingerprint, data_len, align=NETWORK_ALIGN,
                           codec=self.codec) + data_len
        return torch.empty(size, dtype=torch.uint8)

    def _verified(self, key: bytes, record: torch.Tensor, buf: torch.Tensor) -> bool:
        got = unpack_into(host_view(record), key, self.fingerprint, host_view(buf),
                          align=NETWORK_ALIGN, codec=self.codec)
        if got.ok:
            self._rejections.verified()
            return True
        with self._lock:
            self._rejected += 1
        self._rejections.rejected(key, got.bad or f"holds {got.held_bytes} bytes")
        try:
            self.inner.discard([key])
        except Exception as exc:  # a plug-in's bug must not lose this poll's other results
            self._faults.failed("discard", exc)
        return False
