"""Storage records that every tensor-parallel size can read: keys, byte mapping, fingerprint.

The storage tier holds **records**; the host tier stays per rank (a host slot holds this
rank's page of a block, in the engine's page order). A record of a head-sharded group is a
contiguous head range `[first, stop)` of one block of one group, as one rank writes it: for
every layer of the group (canonical ref order), that layer's rows of heads `first..stop-1`,
back to back, in one of two orders (`RecordOrder`):
- head-major: per layer, each head's `block_size` rows `[K|V]` token-major (an LBHNC page);
- token-major: per layer, each token's rows of the heads in head order (an LBNHC page, vLLM's
  GPU default, whatever its kernel block size).
A one-head record is the same bytes in both orders and is always named head-major. A rank
writes its records in the order its own pages have, so at its own TP size a record is the host
slot's bytes themselves (no copy on write or on read) for both page layouts; a reader whose
pages have the other order transposes while it copies its heads out (`GroupRecords.unpack`).
Why not one order for all: the pack would then be paid on every store and every load of one
of the two layouts (measured: 0.68-0.80x the CPU per byte of plain pages for LBNHC when
records were head-major only), while readers of another layout are rare (a fleet serves one
platform) and copy their part anyway.

Its key is the rank key (generation, group, block hash; `key_view.storage_key`) followed by
the order's tag byte (`RecordOrder`) and the range (2 + 2 bytes, little endian). A rank
writes one record per block and group: its own heads (vLLM's rule, `tp.layout.KVHeadShard`),
or none when another replica of its heads writes them (replicated heads when TP > KV heads,
the MLA latent: only the first replica writes). So at the writer's own TP size record counts
and sizes are what they are for plain pages.

A rank that needs heads `[lo, hi)` (`GroupRecords.cover`) takes, in this order (each range
in its own order first, then the other): its own range; else the smallest present record that
contains it (read whole, the part it needs copied: read amplification up to H / (hi - lo),
e.g. a TP=8 rank of an 8-head model reading a TP=1 record reads 8x its bytes); else records
of smaller ranges that tile it, greedily (a TP=1 rank reading TP=2 records reads two
records). The candidates are the records some TP size vLLM accepts writes for that model:
for each divisor d of H, the aligned ranges `[k*d, (k+1)*d)` that meet `[lo, hi)` (H = 8:
sizes 8, 4, 2, 1), each in both orders. A block is present for the rank only when its
candidates cover every head it needs (a bit per candidate, `cover` memoised per bit set).

Groups that stay per TP shape (`tp.layout.TPMode.PER_SHAPE`: Mamba-type states,
cross-attention, pages we cannot map) store this rank's slot bytes as before, under the rank
key followed by `SHAPE_TAG` and 8 bytes of the per-rank layout fingerprint (TP size, rank,
page sizes, page layout, ...): another shape never reads them (a miss).

The tier namespace is the **shared fingerprint** (`shared_fingerprint`): the engine's
identity without TP size, TP rank and page layout (model, weights, dtypes, hash scheme,
pipeline stage: `vllm.fingerprint`), the record format, and per group its TP-free
description: spec type and fields with the model's KV-head count instead of this rank's,
layer names, storage mode. Per-shape groups contribute their type and block size only (their
bytes are guarded by their keys' shape tag).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import xxhash

from kv_offload.canonical import CanonicalKVCaches
from kv_offload.errors import CanonicalizationError, ConfigError, TransferError
from kv_offload.kernels.geometry import HostSlotLayout
from kv_offload.specs import KVCacheGroup, KVCacheSpec
from kv_offload.store.tp.layout import KVHeadShard, group_shard, tp_mode
from kv_offload.store.tp.pages import AttentionPageFormat, group_units

RECORD_FORMAT = 1  # bump when a record's bytes or key change meaning (joins the fingerprint)
SHAPE_TAG = b"\x02"
_GROUP_AT = slice(8, 10)  # the group's bytes in a rank key (key_view.storage_key)
SHAPE_TAG_BYTES = 8


@dataclass(frozen=True)
class TPShare:
    """What this rank needs to share records across TP sizes: the engine's TP-free
    identity (`vllm.fingerprint`), its TP size and rank, and the model's KV-head count."""

    shared_extra: str
    tp_size: int
    tp_rank: int
    total_kv_heads: int


@dataclass(frozen=True)
class HeadRange:
    """Global KV heads `[first, stop)`."""

    first: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.first


class RecordOrder(enum.Enum):
    """The order of a record's rows inside each layer; the value is the key's tag byte.
    (Head-major records keep the tag they had when they were the only order: a cache
    written before token-major records existed still reads.)"""

    HEAD_MAJOR = b"\x01"  # [heads, tokens, K|V]: an LBHNC page
    TOKEN_MAJOR = b"\x03"  # [tokens, heads, K|V]: an LBNHC page


@dataclass(frozen=True)
class Record:
    """One stored record: heads `heads` of a block of a group, rows in `order`."""

    heads: HeadRange
    order: RecordOrder

    @classmethod
    def named(cls, heads: HeadRange, order: RecordOrder) -> Record:
        """The record's one name: a one-head record is the same bytes in both orders."""
        return cls(heads, RecordOrder.HEAD_MAJOR if heads.size == 1 else order)


@dataclass(frozen=True)
class CoverPart:
    """Read `record` whole and take its heads `take` from it."""

    record: Record
    take: HeadRange


@dataclass(frozen=True)
class GroupRecords:
    """One head-sharded group on this rank: its page formats inside a host slot, the heads
    it holds, and the records that can hold them (own record first)."""

    formats: tuple[AttentionPageFormat, ...]
    ref_offsets: tuple[int, ...]  # each layer's page inside the host slot buffer
    shard: KVHeadShard
    candidates: tuple[Record, ...]
    identity: bool  # the own record's bytes are the slot's bytes (no copy)

    @property
    def own(self) -> Record:
        return self.candidates[0]

    def record_bytes(self, record: Record) -> int:
        return record.heads.size * sum(fmt.unit_bytes for fmt in self.formats)

    def cover(self, present: Callable[[int], bool]) -> tuple[CoverPart, ...] | None:
        """The records to read (present(i): candidate i is stored), or None: a miss.
        Ties go to the earlier candidate: a range in this rank's order before the other."""
        own = self.own.heads
        if present(0):
            return (CoverPart(self.own, own),)
        containing = [c for i, c in enumerate(self.candidates) if present(i)
                      and c.heads.first <= own.first and own.stop <= c.heads.stop]
        if containing:
            return (CoverPart(min(containing, key=lambda c: c.heads.size), own),)
        parts, pos = [], own.first
        while pos < own.stop:  # greedy tiling: the record reaching furthest from `pos`
            reach = [c for i, c in enumerate(self.candidates)
                     if present(i) and c.heads.first <= pos < c.heads.stop]
            if not reach:
                return None
            best = max(reach, key=lambda c: c.heads.stop)
            parts.append(CoverPart(best, HeadRange(pos, min(best.heads.stop, own.stop))))
            pos = parts[-1].take.stop
        return tuple(parts)

    def pack(self, slot: torch.Tensor, out: torch.Tensor) -> None:
        """Write this rank's own record (all its heads) from a host slot buffer into `out`."""
        for page, part in self._layer_views(slot, out, self.own):
            part.copy_(page)

    def unpack(self, stored: torch.Tensor, part: CoverPart, slot: torch.Tensor) -> None:
        """Copy heads `part.take` of a stored record `part.record` into a host slot buffer
        (a transpose where the record's order is not the page's)."""
        if stored.numel() != self.record_bytes(part.record):
            raise TransferError(f"a record of heads {part.record.heads} holds {stored.numel()} "
                                f"bytes, {self.record_bytes(part.record)} expected")
        first = part.record.heads.first
        src = slice(part.take.first - first, part.take.stop - first)
        dst = slice(part.take.first - self.shard.first_head,
                    part.take.stop - self.shard.first_head)
        for page, view in self._layer_views(slot, stored, part.record):
            page[:, dst].copy_(view[:, src])

    def _layer_views(self, slot: torch.Tensor, stored: torch.Tensor, record: Record):
        """Pairs of views `(layers, H, ratio, n, row)` of pages in a slot buffer and
        `(layers, heads, ratio, n, row)` of their part of a stored `record`: one pair for
        all layers when they share one format back to back (one copy per block, not one per
        layer: a copy of a few KiB costs more in calls than in bytes), else one per layer.
        Both in the widest integer type dividing a row and both addresses (8 bytes per
        element, not 1: the transposes between orders run near memory speed)."""
        fmt0, layers, size = self.formats[0], len(self.formats), record.heads.size
        if all(f == fmt0 for f in self.formats) and self.ref_offsets == tuple(
                self.ref_offsets[0] + i * fmt0.page_bytes for i in range(layers)):
            runs = [(fmt0, self.ref_offsets[0], 0, layers)]
        else:
            runs, at = [], 0
            for fmt, start in zip(self.formats, self.ref_offsets):
                runs.append((fmt, start, at, 1))
                at += size * fmt.unit_bytes
        for fmt, start, at, count in runs:
            page = slot[start:start + count * fmt.page_bytes]
            part = stored[at:at + count * size * fmt.unit_bytes]
            wide = _wide(fmt.row_bytes, page.data_ptr(), part.data_ptr())
            ratio, n, row = fmt.block_tokens // fmt.kernel_tokens, fmt.kernel_tokens, \
                fmt.row_bytes // wide.itemsize
            page = page.view(wide)
            page = page.view(count, ratio, fmt.num_heads, n, row).permute(0, 2, 1, 3, 4) \
                if fmt.heads_outer else \
                page.view(count, ratio, n, fmt.num_heads, row).permute(0, 3, 1, 2, 4)
            part = part.view(wide)
            yield page, (part.view(count, size, ratio, n, row)
                         if record.order is RecordOrder.HEAD_MAJOR else
                         part.view(count, ratio, n, size, row).permute(0, 3, 1, 2, 4))


def _wide(row_bytes: int, *addresses: int) -> torch.dtype:
    """The widest integer type dividing a row and every address (same type both sides:
    a copy between two types would convert values)."""
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if row_bytes % size == 0 and all(a % size == 0 for a in addresses):
            return dtype
    return torch.int8


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """An int8 buffer starting on a 4096-byte boundary (the filesystem tier's O_DIRECT
    path takes such buffers straight; `_wide` views need at least 8-byte alignment)."""
    raw = torch.empty(nbytes + 4096, dtype=torch.int8)
    skip = -raw.data_ptr() % 4096
    return raw[skip:skip + nbytes]


@dataclass(frozen=True)
class RankRecords:
    """Every group of one rank: `GroupRecords`, or None for a group kept per TP shape
    (whose keys end with `shape_tag`)."""

    groups: tuple[GroupRecords | None, ...]
    shape_tag: bytes
    fingerprint: str  # the shared fingerprint: the storage tier's namespace

    def group_of(self, key: bytes) -> int | None:
        """The group of a rank key or record key (None: not a group of this model)."""
        group = int.from_bytes(key[_GROUP_AT], "little")
        return group if len(key) > _GROUP_AT.stop and group < len(self.groups) else None

    def record_key(self, rank_key: bytes, record: Record) -> bytes:
        return rank_key + record.order.value + record.heads.first.to_bytes(2, "little") + \
            record.heads.stop.to_bytes(2, "little")

    def shape_key(self, rank_key: bytes) -> bytes:
        return rank_key + SHAPE_TAG + self.shape_tag

    def parse(self, key: bytes) -> tuple[bytes, int, Record | None] | None:
        """(rank key, group, record or None for a per-shape key of this shape), or None for
        a key this rank cannot use (another shape, not ours, an order it does not know)."""
        group = self.group_of(key)
        if group is None:
            return None
        if self.groups[group] is None:
            tail = SHAPE_TAG + self.shape_tag
            return (key[:-len(tail)], group, None) if key.endswith(tail) else None
        if len(key) < _GROUP_AT.stop + 6 or key[-5:-4] not in _ORDERS:
            return None
        heads = HeadRange(int.from_bytes(key[-4:-2], "little"), int.from_bytes(key[-2:], "little"))
        return key[:-5], group, Record(heads, _ORDERS[key[-5:-4]])


_ORDERS = {order.value: order for order in RecordOrder}


def candidate_records(total_heads: int, own: Record) -> tuple[Record, ...]:
    """`own` first, then every record a TP size vLLM accepts would write that meets its
    heads, each range in `own`'s order before the other."""
    found = [own]
    other = next(o for o in RecordOrder if o is not own.order)
    for size in range(1, total_heads + 1):
        if total_heads % size:
            continue
        for first in range(0, total_heads, size):
            heads = HeadRange(first, first + size)
            if first < own.heads.stop and own.heads.first < heads.stop:
                for order in (own.order, other):
                    record = Record.named(heads, order)
                    if record not in found:
                        found.append(record)
    return tuple(found)


def own_record(formats: Sequence[AttentionPageFormat], heads: HeadRange,
               dense: bool) -> tuple[Record, bool]:
    """The record this rank writes, in its pages' order, and whether its bytes are the host
    slot's (`dense`: the group's pages fill their slot bytes, no padding between)."""
    if all(not fmt.heads_outer for fmt in formats):  # LBNHC: [tokens, heads] at any kernel size
        record = Record.named(heads, RecordOrder.TOKEN_MAJOR)
        return record, dense
    whole = all(fmt.num_heads == 1 or (fmt.heads_outer and fmt.kernel_tokens == fmt.block_tokens)
                for fmt in formats)  # (LBHNC with split kernel blocks: [ratio, heads, n])
    return Record.named(heads, RecordOrder.HEAD_MAJOR), dense and whole


def rank_records(canonical: CanonicalKVCaches, kv_caches: Mapping[str, torch.Tensor],
                 groups: Sequence[KVCacheGroup], share: TPShare,
                 shape_fingerprint: str) -> RankRecords:
    """This rank's records. A group whose pages cannot be mapped to heads (e.g. legacy
    split K/V caches) is kept per TP shape: a miss across shapes, never wrong bytes."""
    layout = HostSlotLayout.from_canonical(canonical)
    records: list[GroupRecords | None] = []
    for g, group in enumerate(groups):
        try:
            shard = group_shard(group.spec, share.total_kv_heads, share.tp_size, share.tp_rank)
            units = None if shard is None else group_units(canonical, kv_caches, g, group, shard)
        except (ConfigError, CanonicalizationError):
            units = None  # (per shape: safe; the start-up log shows the mode per group)
        if units is None:
            records.append(None)
            continue
        refs = canonical.group_refs[g]
        heads = HeadRange(units.shard.first_head, units.shard.first_head + units.shard.num_heads)
        dense = all(ref.slot_bytes == fmt.page_bytes for ref, fmt in zip(refs, units.formats))
        own, identity = own_record(units.formats, heads, dense)
        records.append(GroupRecords(units.formats, layout.ref_offsets[g], units.shard,
                                    candidate_records(units.shard.total_heads, own), identity))
    shape_tag = xxhash.xxh3_64_digest(shape_fingerprint.encode())
    fingerprint = shared_fingerprint(canonical, groups, records, share.shared_extra)
    return RankRecords(tuple(records), shape_tag, fingerprint)


def shared_fingerprint(canonical: CanonicalKVCaches, groups: Sequence[KVCacheGroup],
                       records: Sequence[GroupRecords | None], extra: str) -> str:
    """The storage namespace every TP size of this model shares (see the module docstring)."""
    described = []
    for group, refs, rec in zip(groups, canonical.group_refs, records):
        layers = [ref.layer_name for ref in refs]
        if rec is None:
            described.append(("per_shape", type(group.spec).__name__, group.spec.block_size))
            continue
        specs = [group.layer_spec(name) for name in layers]
        described.append((tp_mode(group.spec).value, rec.shard.total_heads, layers,
                          [_tp_free(spec) for spec in specs]))
    return xxhash.xxh3_64_hexdigest(repr((RECORD_FORMAT, described, extra)).encode())


def _tp_free(spec: KVCacheSpec) -> tuple:
    """A layer spec's fields without the per-rank ones (head count, page padding)."""
    fields = tuple((f.name, repr(getattr(spec, f.name))) for f in dataclasses.fields(spec)
                   if f.name not in ("num_kv_heads", "page_size_padded"))
    return type(spec).__name__, fields
