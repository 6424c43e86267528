"""Connector metrics for vLLM: the stats payload, its log line and its Prometheus metrics.

Path of a payload (vLLM 0.32): each worker rank and the scheduler fill a `KVOffloadStats`;
the scheduler merges them with `aggregate`, ships `to_dict()` in `SchedulerStats`, and the
front end rebuilds it with `build_stats` to log `reduce()` and feed `KVOffloadPromMetrics`.

`data` is a flat dict of str -> int | float so it survives pickle and msgpack unchanged.
Counters are deltas since the last `reset()`. Gauges describe one tier pool and are stored
per rank (`"bytes_used:host@1"`): `aggregate` cannot tell ranks from time (vLLM uses it for
both, and the front end also accumulates successive steps), so a gauge key keeps its latest
value and reading sums the ranks.

A tier is named in a key by its label (`"hit_tokens:valkey"`, `"bytes_used:disk@0"`:
`kv_offload.backends.tier_label`, one name per tier in metrics, log lines and tool
output), so the front end, which never sees the connector's config, still logs "Valkey hit
tokens" and labels `tier="valkey"`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

COUNTERS: tuple[str, ...] = (
    "lookups", "query_tokens", "hit_tokens",
    "load_jobs", "load_blocks", "load_bytes", "load_seconds", "load_failed_blocks",
    "load_failed_jobs",
    "store_jobs", "store_blocks", "store_bytes", "store_seconds", "store_failed_blocks",
    "store_skipped_blocks",
    "faults_scheduler", "faults_worker", "storage_read_failed_keys", "storage_write_failed_keys",
    "storage_rejected_records", "storage_page_bytes_written", "storage_record_bytes_written",
    "remote_promised_blocks", "remote_foreign",
    "remote_waits", "remote_wait_seconds", "remote_deadlines_missed",
    "find_waits", "find_wait_seconds", "find_deadlines_missed",
)
WAIT_KINDS: tuple[str, ...] = ("remote", "find")
TIER_COUNTERS: tuple[str, ...] = ("hit_tokens",)  # "<name>:<tier label>"
GAUGES: tuple[str, ...] = ("bytes_used", "bytes_total", "servers_down")  # "<name>:<tier>@rank"
HOST = "host"  # the host tier's label (a storage tier's: kv_offload.backends.tier_label)
DIRECTIONS: tuple[str, ...] = ("load", "store")
SIDES: tuple[str, ...] = ("scheduler", "worker")
STORAGE_OPS: tuple[str, ...] = ("read", "write")

_GAUGE_SEP = "@"
_TIER_SEP = ":"
_GB = 1e9
_GIB = float(1 << 30)


def _tier_key(name: str, tier: str) -> str:
    return f"{name}{_TIER_SEP}{tier}"


def _gauge_key(name: str, tier: str, rank: int) -> str:
    return f"{_tier_key(name, tier)}{_GAUGE_SEP}{rank}"


def _is_counter(key: str) -> bool:
    return key in COUNTERS or (_GAUGE_SEP not in key and _TIER_SEP in key)


def _check_tier(tier: object) -> None:
    if not isinstance(tier, str) or not tier or _GAUGE_SEP in tier or _TIER_SEP in tier:
        raise ValueError(f"a kv_offload tier label must be a non-empty str without "
                         f"{_GAUGE_SEP!r} or {_TIER_SEP!r}, got {tier!r}")


def _check_key(key: object) -> None:
    """Raise unless `key` is a counter name, `<tier counter>:<tier>` or
    `<gauge>:<tier>@<rank>`."""
    if not isinstance(key, str):
        raise TypeError(f"kv_offload stats key {key!r} must be a str, got {type(key).__name__}")
    if key in COUNTERS:
        return
    named, sep, rank = key.partition(_GAUGE_SEP)
    name, tier_sep, tier = named.partition(_TIER_SEP)
    if tier_sep and tier and _TIER_SEP not in tier and (
            (sep and name in GAUGES and rank.isdigit())
            or (not sep and name in TIER_COUNTERS)):
        return
    raise ValueError(
        f"unknown kv_offload stats key {key!r}; expected one of {list(COUNTERS)}, "
        f"'<counter>:<tier>' with counter in {list(TIER_COUNTERS)}, or "
        f"'<gauge>:<tier>@<rank>' with gauge in {list(GAUGES)}"
    )


def _check_value(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"kv_offload stats value for {key!r} must be int or float, "
            f"got {type(value).__name__}"
        )
    if value < 0:
        raise ValueError(f"kv_offload stats value for {key!r} must be >= 0, got {value}")


def _check_amounts(**amounts: int | float) -> None:
    for name, value in amounts.items():
        _check_value(name, value)


def gauge_sum(data: Mapping[str, Any], name: str, tier: str) -> int | float | None:
    """Sum of gauge `name` of `tier` over the ranks present in `data`; None when no rank
    set it."""
    prefix = _tier_key(name, tier) + _GAUGE_SEP
    values = [v for k, v in data.items() if k.startswith(prefix)]
    return sum(values) if values else None


def _title(tier: str) -> str:
    return tier[:1].upper() + tier[1:]


def _rate(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


@dataclass
class KVOffloadStats(KVConnectorStats):
    """Counters and tier gauges of the offload connector over one interval.

    Absent keys count as 0 (counters) or "not reported" (gauges), so a payload that is an
    empty dict merges like a fresh object.
    """

    def __post_init__(self) -> None:
        for key, value in self.data.items():
            _check_key(key)
            _check_value(key, value)

    def count(self, name: str, tier: str | None = None) -> int | float:
        """Value of counter `name` (of `tier`, for a tier counter; 0 when never moved)."""
        return self.data.get(name if tier is None else _tier_key(name, tier), 0)

    def tiers(self) -> list[str]:
        """The tier labels this payload names: the host tier first, then the others."""
        found = {k.partition(_GAUGE_SEP)[0].partition(_TIER_SEP)[2] for k in self.data
                 if _TIER_SEP in k}
        return sorted(found, key=lambda t: (t != HOST, t))

    def _add(self, name: str, amount: int | float) -> None:
        if amount:
            self.data[name] = self.data.get(name, 0) + amount

    def record_lookup(self, query_tokens: int, hit_tokens: int, tier: str | None = None) -> None:
        """One request looked up: tokens asked for, tokens hit, and the tier the hit lies in
        (its label: ``"host"``, or the storage tier's; a request's hit has one source)."""
        _check_amounts(query_tokens=query_tokens, hit_tokens=hit_tokens)
        if hit_tokens and tier is None:
            raise ValueError(f"record_lookup: {hit_tokens} hit tokens need their tier")
        self._add("lookups", 1)
        self._add("query_tokens", query_tokens)
        self._add("hit_tokens", hit_tokens)
        if hit_tokens:
            _check_tier(tier)
            self._add(_tier_key("hit_tokens", tier), hit_tokens)

    def record_load(
        self, blocks: int, nbytes: int, seconds: float, failed_blocks: int = 0
    ) -> None:
        """One finished load job (offload tiers -> engine); a job with failures counts once."""
        _check_amounts(blocks=blocks, nbytes=nbytes, seconds=seconds,
                       failed_blocks=failed_blocks)
        self._add("load_jobs", 1)
        self._add("load_blocks", blocks)
        self._add("load_bytes", nbytes)
        self._add("load_seconds", seconds)
        self._add("load_failed_blocks", failed_blocks)
        self._add("load_failed_jobs", 1 if failed_blocks else 0)

    def record_store(
        self,
        blocks: int,
        nbytes: int,
        seconds: float,
        failed_blocks: int = 0,
        skipped_blocks: int = 0,
    ) -> None:
        """One finished store job (engine -> offload tiers); skipped = no room to store."""
        _check_amounts(blocks=blocks, nbytes=nbytes, seconds=seconds,
                       failed_blocks=failed_blocks, skipped_blocks=skipped_blocks)
        self._add("store_jobs", 1)
        self._add("store_blocks", blocks)
        self._add("store_bytes", nbytes)
        self._add("store_seconds", seconds)
        self._add("store_failed_blocks", failed_blocks)
        self._add("store_skipped_blocks", skipped_blocks)

    def record_waits(self, counts: Mapping[str, int | float]) -> None:
        """The scheduler side's waits for blocks other engines stored (store_waits.py) and
        the blocks a prefill server promised to decode servers (pd_params.py)."""
        for name, amount in counts.items():
            _check_key(name)
            _check_amounts(**{name: amount})
            self._add(name, amount)

    def record_faults(self, *, scheduler: int = 0, worker: int = 0) -> None:
        """Faults contained (an exception or a timeout in our code, a tier or a plug-in
        that the engine never saw: the affected loads recompute, stores are skipped)."""
        _check_amounts(scheduler=scheduler, worker=worker)
        self._add("faults_scheduler", scheduler)
        self._add("faults_worker", worker)

    def record_storage_failures(self, read_keys: int, write_keys: int,
                                rejected_records: int = 0) -> None:
        """Keys the storage tier failed to read (missing, corrupt, server down) or to write
        (full disk, server down); of the reads, records it refused: a bad header, checksum
        or keyed tag (damaged, foreign, or forged by a writer without the shared secret)."""
        _check_amounts(read_keys=read_keys, write_keys=write_keys,
                       rejected_records=rejected_records)
        self._add("storage_read_failed_keys", read_keys)
        self._add("storage_write_failed_keys", write_keys)
        self._add("storage_rejected_records", rejected_records)

    def record_storage_writes(self, page_bytes: int, record_bytes: int) -> None:
        """Bytes of the pages the storage tier stored, and of the records it stored for
        them: their ratio is what ``compression`` saves (headers included)."""
        _check_amounts(page_bytes=page_bytes, record_bytes=record_bytes)
        self._add("storage_page_bytes_written", page_bytes)
        self._add("storage_record_bytes_written", record_bytes)

    def set_usage(self, tier: str, used: int, total: int, *, servers_down: int = 0,
                  rank: int = 0) -> None:
        """Bytes used/budgeted in `tier`'s pool of `rank` (each rank owns its pools), and how
        many of the tier's servers are unreachable now (0 for a tier without servers)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"set_usage rank must be an int >= 0, got {rank!r}")
        _check_tier(tier)
        _check_amounts(used=used, total=total, servers_down=servers_down)
        for name, value in zip(GAUGES, (used, total, servers_down)):
            self.data[_gauge_key(name, tier, rank)] = value

    def usage(self, name: str, tier: str) -> int | float | None:
        """Gauge `name` of `tier` summed over ranks; None when no rank reported it."""
        return gauge_sum(self.data, name, tier)

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        """True when no counter moved and no gauge was set."""
        return not any(self.data.values()) and not any(_GAUGE_SEP in k for k in self.data)

    def aggregate(self, other: KVConnectorStats) -> KVOffloadStats:
        """A new object: counters summed, gauges per rank taken from `other` (the newer)."""
        if not isinstance(other, KVOffloadStats):
            raise TypeError(
                f"KVOffloadStats can only aggregate KVOffloadStats, got {type(other).__name__}"
            )
        merged = dict(self.data)
        for key, value in other.data.items():
            merged[key] = merged.get(key, 0) + value if _is_counter(key) else value
        return KVOffloadStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        """Summary for vLLM's "KV Transfer metrics:" log line."""
        summary: dict[str, int | float] = {
            "Lookups": self.count("lookups"),
            "Hit rate (%)": round(
                100 * _rate(self.count("hit_tokens"), self.count("query_tokens")), 1),
            "Hit tokens": self.count("hit_tokens"),
            "Load GB/s": round(
                _rate(self.count("load_bytes"), self.count("load_seconds")) / _GB, 3),
            "Store GB/s": round(
                _rate(self.count("store_bytes"), self.count("store_seconds")) / _GB, 3),
            "Failed blocks (load/store)": (
                self.count("load_failed_blocks") + self.count("store_failed_blocks")),
            "Skipped store blocks": self.count("store_skipped_blocks"),
            "Faults contained": self.count("faults_scheduler") + self.count("faults_worker"),
            "Storage failed keys (read/write)": (
                self.count("storage_read_failed_keys") + self.count("storage_write_failed_keys")),
        }
        for tier in self.tiers():
            if tier != HOST and self.count("hit_tokens", tier):
                summary[f"{_title(tier)} hit tokens"] = self.count("hit_tokens", tier)
            used, total = self.usage("bytes_used", tier), self.usage("bytes_total", tier)
            if used is not None and total:
                summary[f"{_title(tier)} used (GiB)"] = round(used / _GIB, 3)
            if self.usage("servers_down", tier):
                summary[f"{_title(tier)} servers down"] = self.usage("servers_down", tier)
        return summary


def build_stats(data: Mapping[str, Any] | None) -> KVOffloadStats:
    """Rebuild stats from a `to_dict()` payload (None or {} gives empty stats).

    Raises TypeError/ValueError naming the key when the payload is not ours.
    """
    return KVOffloadStats(data=dict(data) if data else {})


class KVOffloadPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters and gauges of the offload connector, one child per engine.

    Metric classes come from vLLM's `metric_types` (prometheus_client or its Ray wrappers).
    Counters are named without `_total`: prometheus_client appends it on exposition.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # metric name -> {(engine_idx, extra label value or None): child}
        self._children: dict[str, dict[tuple[int, str | None], Any]] = {}
        self._parents: dict[str, Any] = {}
        tiers = configured_tiers(vllm_config)  # (others get their series when first seen)
        self._add_counter("hit_tokens", "Offloaded tokens hit, by tier.", "tier", tiers)
        self._add_counter("query_tokens", "Tokens looked up in the offload tiers.")
        self._add_counter("loaded_bytes", "Bytes loaded from offload tiers into the engine.")
        self._add_counter("stored_bytes", "Bytes stored from the engine into offload tiers.")
        self._add_counter("load_seconds", "Seconds spent in load jobs.")
        self._add_counter("store_seconds", "Seconds spent in store jobs.")
        self._add_counter("failed_blocks", "Blocks whose transfer failed, by direction.",
                          "direction", DIRECTIONS)
        self._add_counter("faults", "Faults contained without reaching the engine (loads "
                          "recomputed, stores skipped), by side.", "side", SIDES)
        self._add_counter("storage_failed_keys", "Keys the storage tier failed to read or "
                          "write (missing, corrupt, full disk, server down), by op.", "op",
                          STORAGE_OPS)
        self._add_counter("storage_rejected_records", "Stored records refused on read (bad "
                          "header, checksum or keyed tag: damaged, foreign, or written "
                          "without the shared secret); each was a miss and was removed.")
        self._add_counter("storage_page_bytes_written", "Bytes of the pages the storage "
                          "tier stored (before compression).")
        self._add_counter("storage_record_bytes_written", "Bytes the storage tier stored "
                          "for those pages: records, headers included (after compression).")
        self._add_counter("promised_blocks", "Blocks a prefill server stored for decode "
                          "servers and promised them in kv_transfer_params.")
        self._add_counter("waits", "Lookups that waited for blocks another engine stored: "
                          "a prefill server's promise (remote) or an idle engine's first "
                          "lookup (find).", "kind", WAIT_KINDS)
        self._add_counter("wait_seconds", "Seconds lookups waited, by kind.", "kind",
                          WAIT_KINDS)
        self._add_counter("wait_deadlines_missed", "Waits that ended at their deadline "
                          "short of the blocks waited for (the rest was recomputed).",
                          "kind", WAIT_KINDS)
        for short, doc in (("tier_bytes_used", "Bytes in use in each offload tier"),
                           ("tier_bytes_total", "Byte budget of each offload tier"),
                           ("tier_servers_down", "Servers of each offload tier that do not "
                            "answer now (its reads and writes are misses meanwhile)")):
            self._add_metric(self._gauge_cls, short, f"{doc}, summed over ranks.", "tier",
                             tiers, multiprocess_mode="mostrecent")

    def _add_counter(self, short: str, doc: str, label: str | None = None,
                     values: tuple[str, ...] = ()) -> None:
        self._add_metric(self._counter_cls, short, doc, label, values)

    def _add_metric(self, cls: type, short: str, doc: str, label: str | None,
                    values: tuple[str, ...], **kwargs: Any) -> None:
        extra = [label] if label else []
        parent = cls(name=f"vllm:kv_offload_{short}", documentation=doc,
                     labelnames=self._labelnames + extra, **kwargs)
        self._parents[short] = parent
        self._children[short] = {
            (engine, value): parent.labels(*engine_values, *([value] if label else []))
            for engine, engine_values in self.per_engine_labelvalues.items()
            for value in (values if label else (None,))
        }

    def _child(self, short: str, engine_idx: int, label: str | None) -> Any:
        children = self._children[short]
        child = children.get((engine_idx, label))
        if child is None:  # (a tier not in the config this process saw: its own series)
            child = children[(engine_idx, label)] = self._parents[short].labels(
                *self.per_engine_labelvalues[engine_idx], label)
        return child

    def _inc(self, short: str, engine_idx: int, amount: int | float,
             label: str | None = None) -> None:
        if amount:  # Ray's counter ignores 0 too; skipping keeps both the same
            self._child(short, engine_idx, label).inc(amount)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one step's counters; set a tier's gauges when the step reported them."""
        stats = build_stats(transfer_stats_data)
        for tier in stats.tiers():
            self._inc("hit_tokens", engine_idx, stats.count("hit_tokens", tier), tier)
            for name in GAUGES:
                value = stats.usage(name, tier)
                if value is not None:
                    self._child(f"tier_{name}", engine_idx, tier).set(value)
        self._inc("query_tokens", engine_idx, stats.count("query_tokens"))
        self._inc("loaded_bytes", engine_idx, stats.count("load_bytes"))
        self._inc("stored_bytes", engine_idx, stats.count("store_bytes"))
        self._inc("load_seconds", engine_idx, stats.count("load_seconds"))
        self._inc("store_seconds", engine_idx, stats.count("store_seconds"))
        for direction in DIRECTIONS:
            self._inc("failed_blocks", engine_idx, stats.count(f"{direction}_failed_blocks"),
                      direction)
        for side in SIDES:
            self._inc("faults", engine_idx, stats.count(f"faults_{side}"), side)
        for op in STORAGE_OPS:
            self._inc("storage_failed_keys", engine_idx,
                      stats.count(f"storage_{op}_failed_keys"), op)
        self._inc("storage_rejected_records", engine_idx,
                  stats.count("storage_rejected_records"))
        for short in ("storage_page_bytes_written", "storage_record_bytes_written"):
            self._inc(short, engine_idx, stats.count(short))
        self._inc("promised_blocks", engine_idx, stats.count("remote_promised_blocks"))
        for kind in WAIT_KINDS:
            self._inc("waits", engine_idx, stats.count(f"{kind}_waits"), kind)
            self._inc("wait_seconds", engine_idx, stats.count(f"{kind}_wait_seconds"), kind)
            self._inc("wait_deadlines_missed", engine_idx,
                      stats.count(f"{kind}_deadlines_missed"), kind)


def configured_tiers(vllm_config: Any) -> tuple[str, ...]:
    """The labels of the tiers a server's connector config sets up (the host tier, and the
    storage tier's when there is one), read without checking the config (the engine does)."""
    from kv_offload.backends import tier_label

    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    name = extra.get("storage_tier") or ("filesystem" if extra.get("fs_root_dir") else None)
    return (HOST,) if not isinstance(name, str) else (HOST, tier_label(name))


def build_prom_metrics(
    vllm_config: VllmConfig,
    metric_types: dict[type, type],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> KVOffloadPromMetrics:
    """What the connector's `build_prom_metrics` classmethod returns."""
    return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = [
    "COUNTERS", "DIRECTIONS", "GAUGES", "HOST", "TIER_COUNTERS", "KVOffloadPromMetrics",
    "KVOffloadStats", "build_prom_metrics", "build_stats", "configured_tiers", "gauge_sum",
]
