"""KV events for cache-aware routers: which blocks our tiers hold, in vLLM's own event classes.

Contents:
- `MEDIUM_HOST` ("CPU"), `MEDIUM_STORAGE` ("STORAGE"): the media we publish; vLLM's own
  names, the ones its offloading connector uses for its CPU and storage tiers.
- `GroupEventSpec`: what a store event says about a KV-cache group (block size, kind, window).
- `KVEvents`: events off (the default): reports are applied, nothing is recorded or published.
- `KVEventTracker`: events on: records planned stores, turns the ranks' reports into
  `BlockStored` / `BlockRemoved` events, hands them to vLLM through `take`.
- `make_kv_events(vllm_config, kv_cache_config, hash_block_size, storage_name)`: the
  connector's choice between the two; `group_event_specs(kv_cache_config)`: its groups;
  `kv_events_enabled(vllm_config)`: whether vLLM publishes events at all.

How. vLLM's scheduler publishes, after every step, its own events (medium "GPU") followed by
what the connector's `take_events()` returns, through the publisher of `--kv-events-config`
(ZMQ). A router joins them by block hash: ours are vLLM's own block hashes (a key's hash is
the hash vLLM gives the group's block, `hashes[(i + 1) * per_block - 1]`, also when a group's
blocks span several hash blocks), converted as vLLM converts its own
(`maybe_convert_block_hash`: 64-bit ints by default, the raw bytes with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).

When. A block is stored in a medium once every worker rank holds it there (tensor
parallelism: each rank holds its shard; a block some rank lacks cannot be loaded), and
removed once that stops being true. The scheduler side learns where each rank holds a key
from the ranks' reports (`RankKeys`, one bit per tier: a host key written through to the
storage tier is in both media). `apply_reports` compares, for every key a report names, the
media all ranks held it in before and after the report: work per step is proportional to
the keys reported, never a scan of all keys. A rank's reset (vLLM's reset of the connector)
removes every key that rank held: then, once, the work is proportional to those keys.

Payload. `BlockStored` carries the block's tokens and its parent's hash (a router that keys
blocks by their tokens needs them); only a live request has them. So the scheduler records
them when it plans a store (`record_blocks`: the hash of the block before, and the block's
token ids packed as 32-bit ints into one bytes object, per group in a dict of bytes -> bytes
that the garbage collector never walks) and keeps them while some medium holds the block, so
an eviction from host memory to disk, or a read back from disk into host memory, is
announced with the same payload. About 235 bytes per block of 32 tokens held (measured with
tracemalloc); nothing while events are off. A payload whose store never lands is dropped
after `PENDING_STEPS` steps. A key learnt without a plan (a disk tier's inventory after a
restart, keys another engine wrote to a shared tier) is announced with vLLM's placeholder
payload: no parent, no tokens, `block_size` 0 (what vLLM's offloading connector sends for a
key it has no payload for); once a request loads such a block, its payload is recorded too,
so its later events (a read back into host memory) carry it. `extra_keys` (multimodal,
cache-salt keys) are not sent, as vLLM's offloading connector does not send them either;
LoRA id and name are.

`BlockStored.ownership` names the storage tier ("filesystem", "valkey", "s3" or the
"module:Class" of a custom tier) on "STORAGE" events: vLLM's field for "secondary offloading
tier identifier"; host events leave it None, as vLLM's primary CPU tier does. `locality` is
left None (unspecified): a filesystem tier may be a local disk or a shared mount.

Faults: an error while computing events is contained (counted, logged once per episode) and
never stops the reports from being applied: hits stay right, only events are lost.
"""

from __future__ import annotations

import logging
from array import array
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from kv_offload.runtime.faults import FaultLog
from kv_offload.types import HOST_BIT, STORAGE_BIT, OffloadKey
from kv_offload.vllm.metadata import RankReport
from kv_offload.vllm.scheduler.rank_keys import RankKeys

logger = logging.getLogger(__name__)

MEDIUM_HOST = MEDIUM_CPU  # "CPU": our host-memory tier
__all__ = ["MEDIUM_HOST", "MEDIUM_STORAGE", "GroupEventSpec", "KVEventTracker", "KVEvents",
           "group_event_specs", "kv_events_enabled", "make_kv_events"]

PENDING_STEPS = 1000  # steps a planned store's payload waits for its store to be reported
_MEDIA = ((HOST_BIT, MEDIUM_HOST), (STORAGE_BIT, MEDIUM_STORAGE))
_INT_PARENT = 255  # payload length byte that marks an int parent hash (tests use int hashes)


@dataclass(frozen=True)
class _Planned:
    step: int
    keys: list[OffloadKey]  # the keys a store planned in `step` names


@dataclass(frozen=True)
class GroupEventSpec:
    """What a `BlockStored` event says about one KV-cache group."""

    block_size: int  # tokens per block of this group (a multiple of the hash block size)
    kind: str | None = None  # vLLM's KVCacheSpecKind value, e.g. "full_attention"
    sliding_window: int | None = None


class KVEvents:
    """Events off: the scheduler's hooks do only what they must (apply the reports)."""

    def apply_reports(self, keys: RankKeys, reports: Mapping[int, RankReport]) -> None:
        """Apply the ranks' reports to `keys` (and, with events on, turn them into events)."""
        for rank, report in reports.items():
            keys.apply(rank, report.keys, report.held, report.reset)

    def record_blocks(self, request: Any, group: int, blocks: Sequence[int]) -> None:
        """The scheduler plans to store or load `blocks` (indices in `group`) of the live
        `request`: the moment their payload can be recorded."""

    def take(self) -> list[KVCacheEvent]:
        """Events since the last call (vLLM's `take_events`)."""
        return []


class KVEventTracker(KVEvents):
    """Events on: `BlockStored` / `BlockRemoved` for the host ("CPU") and storage
    ("STORAGE") media, from the ranks' reports. Driven by the scheduler's thread only."""

    def __init__(self, groups: Sequence[GroupEventSpec], hash_block_size: int,
                 storage_name: str | None = None) -> None:
        for g, spec in enumerate(groups):
            if spec.block_size % hash_block_size:
                raise ValueError(f"group {g} block size {spec.block_size} is not a multiple "
                                 f"of the hash block size {hash_block_size}")
        self.groups = list(groups)
        self.hash_block_size = hash_block_size
        self.storage_name = storage_name
        # Per group: block hash -> packed payload (parent hash, token ids); see `_pack`.
        self._payloads: list[dict[bytes | int, bytes]] = [{} for _ in groups]
        self._loras: list[dict[bytes | int, tuple[int, str]]] = [{} for _ in groups]
        self._pending: deque[_Planned] = deque()  # stores planned, oldest first
        self._step = 0
        self._events: list[KVCacheEvent] = []
        self.faults = FaultLog("kv-offload events")

    # --- hooks ---

    def record_blocks(self, request: Any, group: int, blocks: Sequence[int]) -> None:
        try:
            self._record(request, group, blocks)
        except Exception as exc:  # a payload lost is a placeholder event, never a lost store
            self.faults.failed("record_blocks", exc)

    def apply_reports(self, keys: RankKeys, reports: Mapping[int, RankReport]) -> None:
        self._step += 1
        try:
            before = self._masks(keys, reports)
        except Exception as exc:
            self.faults.failed("events before report", exc)
            before = None
        super().apply_reports(keys, reports)  # whatever happens to the events
        try:
            if before:
                self._publish(keys, before)
            self._expire(keys)
        except Exception as exc:
            self.faults.failed("events after report", exc)
        else:
            self.faults.succeeded("events after report")

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    @property
    def num_payloads(self) -> int:
        """Blocks whose payload is kept (tests, tools)."""
        return sum(len(payloads) for payloads in self._payloads)

    # --- payloads ---

    def _record(self, request: Any, group: int, blocks: Sequence[int]) -> None:
        block_size = self.groups[group].block_size
        per_block = block_size // self.hash_block_size
        hashes, tokens = request.block_hashes, request.all_token_ids
        payloads = self._payloads[group]
        lora = request.lora_request
        planned = []
        for i in blocks:
            block_hash = hashes[(i + 1) * per_block - 1]
            parent = hashes[i * per_block - 1] if i else None
            payloads[block_hash] = _pack(parent, tokens[i * block_size:(i + 1) * block_size])
            if lora is not None:
                self._loras[group][block_hash] = (lora.adapter_id, lora.name)
            planned.append((block_hash, group))
        self._pending.append(_Planned(self._step, planned))

    def _forget(self, key: OffloadKey) -> None:
        block_hash, group = key
        self._payloads[group].pop(block_hash, None)
        self._loras[group].pop(block_hash, None)

    def _expire(self, keys: RankKeys) -> None:
        """Drop the payloads of stores planned `PENDING_STEPS` ago that no medium holds
        (skipped or failed stores). O(keys planned then)."""
        pending = self._pending
        while pending and pending[0].step <= self._step - PENDING_STEPS:
            for key in pending.popleft().keys:
                if not keys.held_by_all_mask(key):
                    self._forget(key)

    # --- events ---

    def _masks(self, keys: RankKeys, reports: Mapping[int, RankReport]) -> dict[OffloadKey, int]:
        """Every key the reports name (a reset names every key of its rank), with the media
        all ranks hold it in now, before the reports are applied."""
        touched: dict[OffloadKey, None] = {}
        for rank, report in reports.items():
            if report.reset:
                touched.update(dict.fromkeys(keys.keys_of(rank)))
            touched.update(dict.fromkeys(report.keys))
        return {key: keys.held_by_all_mask(key) for key in touched}

    def _publish(self, keys: RankKeys, before: dict[OffloadKey, int]) -> None:
        removed: dict[tuple[int, str], list[bytes | int]] = {}  # (group, medium) -> hashes
        stored: list[KVCacheEvent] = []
        for key, was in before.items():
            now = keys.held_by_all_mask(key)
            if now == was:
                continue
            block_hash, group = key
            for bit, medium in _MEDIA:
                if was & bit and not now & bit:
                    removed.setdefault((group, medium), []).append(_external(block_hash))
                elif now & bit and not was & bit:
                    stored.append(self._stored(key, medium))
            if not now:
                self._forget(key)  # held nowhere: a later store records it again
        events = self._events
        for (group, medium), hashes in removed.items():
            events.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group,
                                       ownership=self._ownership(medium)))
        events.extend(stored)

    def _stored(self, key: OffloadKey, medium: str) -> BlockStored:
        block_hash, group = key
        spec = self.groups[group]
        payload = self._payloads[group].get(block_hash)
        if payload is None:  # learnt without a plan: vLLM's placeholder payload
            parent, token_ids, block_size = None, [], 0
        else:
            parent, token_ids = _unpack(payload)
            block_size = spec.block_size
        lora_id, lora_name = self._loras[group].get(block_hash, (None, None))
        return BlockStored(
            block_hashes=[_external(block_hash)],
            parent_block_hash=None if parent is None else _external(parent),
            token_ids=token_ids, block_size=block_size, lora_id=lora_id, medium=medium,
            lora_name=lora_name, group_idx=group, kv_cache_spec_kind=spec.kind,
            kv_cache_spec_sliding_window=spec.sliding_window,
            ownership=self._ownership(medium))

    def _ownership(self, medium: str) -> str | None:
        return self.storage_name if medium == MEDIUM_STORAGE else None


def make_kv_events(vllm_config: Any, kv_cache_config: Any, hash_block_size: int,
                   storage_name: str | None) -> KVEvents:
    """A tracker when vLLM publishes KV events (`--kv-events-config` with
    `enable_kv_cache_events`), else the do-nothing `KVEvents`: with events off vLLM drains
    `take_events()` all the same, so nothing may accumulate."""
    if not kv_events_enabled(vllm_config):
        return KVEvents()
    return KVEventTracker(group_event_specs(kv_cache_config), hash_block_size, storage_name)


def kv_events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (then the workers also report the storage copies
    of host keys, which the "STORAGE" medium's events need)."""
    events_config = getattr(vllm_config, "kv_events_config", None)
    return events_config is not None and bool(events_config.enable_kv_cache_events)


def group_event_specs(kv_cache_config: Any) -> list[GroupEventSpec]:
    """Per vLLM KV-cache group (in vLLM's order): its block size, kind and window."""
    specs = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs.append(GroupEventSpec(spec.block_size, get_kv_cache_spec_kind(spec).value,
                                    get_kv_cache_spec_sliding_window(spec)))
    return specs


def _external(block_hash: bytes | int) -> bytes | int:
    """A hash as vLLM publishes its own (int hashes, used only by tests, pass as they are)."""
    return maybe_convert_block_hash(block_hash) if isinstance(block_hash, bytes) else block_hash


def _pack(parent: bytes | int | None, token_ids: Iterable[int]) -> bytes:
    """One bytes object (the collector never tracks it): a length byte, the parent hash
    (bytes; an int hash as 32 little-endian bytes after length byte 255), the token ids
    as 32-bit unsigned ints."""
    if parent is None:
        head = b"\x00"
    elif isinstance(parent, int):
        head = bytes([_INT_PARENT]) + parent.to_bytes(32, "little", signed=True)
    else:
        if not 0 < len(parent) < _INT_PARENT:
            raise ValueError(f"parent block hash of {len(parent)} bytes; expected 1 to "
                             f"{_INT_PARENT - 1}")
        head = bytes([len(parent)]) + parent
    return head + array("I", token_ids).tobytes()


def _unpack(payload: bytes) -> tuple[bytes | int | None, list[int]]:
    length = payload[0]
    if length == _INT_PARENT:
        parent: bytes | int | None = int.from_bytes(payload[1:33], "little", signed=True)
        start = 33
    else:
        parent = payload[1:1 + length] if length else None
        start = 1 + length
    tokens = array("I")
    tokens.frombytes(payload[start:])
    return parent, tokens.tolist()

