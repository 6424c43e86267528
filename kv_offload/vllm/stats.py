"""Connector metrics for vLLM: the stats payload, its log line and its Prometheus metrics.

Path of a payload (vLLM 0.32): each worker rank and the scheduler fill a `KVOffloadStats`;
the scheduler merges them with `aggregate`, ships `to_dict()` in `SchedulerStats`, and the
front end rebuilds it with `build_stats` to log `reduce()` and feed `KVOffloadPromMetrics`.

`data` is a flat dict of str -> int | float so it survives pickle and msgpack unchanged.
Counters are deltas since the last `reset()`. Gauges describe one tier pool and are stored
per rank (`"host_bytes_used@1"`): `aggregate` cannot tell ranks from time (vLLM uses it for
both, and the front end also accumulates successive steps), so a gauge key keeps its latest
value and reading sums the ranks.
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
    "lookups", "query_tokens", "hit_tokens", "hit_tokens_host", "hit_tokens_disk",
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
GAUGES: tuple[str, ...] = ("host_bytes_used", "host_bytes_total", "disk_bytes_used",
                           "disk_bytes_total")
TIERS: tuple[str, ...] = ("host", "disk")
DIRECTIONS: tuple[str, ...] = ("load", "store")
SIDES: tuple[str, ...] = ("scheduler", "worker")
STORAGE_OPS: tuple[str, ...] = ("read", "write")

_GAUGE_SEP = "@"
_GB = 1e9
_GIB = float(1 << 30)


def _gauge_key(name: str, rank: int) -> str:
    return f"{name}{_GAUGE_SEP}{rank}"


def _check_key(key: object) -> None:
    """Raise unless `key` is a counter name or `<gauge name>@<rank>`."""
    if not isinstance(key, str):
        raise TypeError(f"kv_offload stats key {key!r} must be a str, got {type(key).__name__}")
    if key in COUNTERS:
        return
    name, sep, rank = key.partition(_GAUGE_SEP)
    if sep and name in GAUGES and rank.isdigit():
        return
    raise ValueError(
        f"unknown kv_offload stats key {key!r}; expected one of {list(COUNTERS)} "
        f"or '<gauge>@<rank>' with gauge in {list(GAUGES)}"
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


def gauge_sum(data: Mapping[str, Any], name: str) -> int | float | None:
    """Sum of gauge `name` over the ranks present in `data`; None when no rank set it."""
    prefix = name + _GAUGE_SEP
    values = [v for k, v in data.items() if k.startswith(prefix)]
    return sum(values) if values else None


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

    def count(self, name: str) -> int | float:
        """Value of counter `name` (0 when never moved)."""
        return self.data.get(name, 0)

    def _add(self, name: str, amount: int | float) -> None:
        if amount:
            self.data[name] = self.data.get(name, 0) + amount

    def record_lookup(
        self, query_tokens: int, hit_tokens: int, host_tokens: int, disk_tokens: int
    ) -> None:
        """One request looked up: tokens asked for, tokens hit, and where the hit lies."""
        _check_amounts(query_tokens=query_tokens, hit_tokens=hit_tokens,
                       host_tokens=host_tokens, disk_tokens=disk_tokens)
        self._add("lookups", 1)
        self._add("query_tokens", query_tokens)
        self._add("hit_tokens", hit_tokens)
        self._add("hit_tokens_host", host_tokens)
        self._add("hit_tokens_disk", disk_tokens)

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

    def set_usage(
        self,
        host_used: int,
        host_total: int,
        disk_used: int = 0,
        disk_total: int = 0,
        *,
        rank: int = 0,
    ) -> None:
        """Bytes used/budgeted in the pools of `rank` (each rank owns its pools)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"set_usage rank must be an int >= 0, got {rank!r}")
        _check_amounts(host_used=host_used, host_total=host_total, disk_used=disk_used,
                       disk_total=disk_total)
        values = (host_used, host_total, disk_used, disk_total)
        for name, value in zip(GAUGES, values):
            self.data[_gauge_key(name, rank)] = value

    def usage(self, name: str) -> int | float | None:
        """Gauge `name` summed over ranks; None when no rank reported it."""
        return gauge_sum(self.data, name)

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
            merged[key] = merged.get(key, 0) + value if key in COUNTERS else value
        return KVOffloadStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        """Summary for vLLM's "KV Transfer metrics:" log line."""
        summary: dict[str, int | float] = {
            "Lookups": self.count("lookups"),
            "Hit rate (%)": round(
                100 * _rate(self.count("hit_tokens"), self.count("query_tokens")), 1),
            "Hit tokens": self.count("hit_tokens"),
            "Disk hit tokens": self.count("hit_tokens_disk"),
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
        for tier in TIERS:
            used, total = self.usage(f"{tier}_bytes_used"), self.usage(f"{tier}_bytes_total")
            if used is not None and total:
                summary[f"{tier.capitalize()} used (GiB)"] = round(used / _GIB, 3)
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
        self._add_counter("hit_tokens", "Offloaded tokens hit, by tier.", "tier", TIERS)
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
        for suffix, doc in (("used", "Bytes in use"), ("total", "Byte budget")):
            self._add_metric(self._gauge_cls, f"tier_bytes_{suffix}",
                             f"{doc} in each offload tier, summed over ranks.", "tier", TIERS,
                             multiprocess_mode="mostrecent")

    def _add_counter(self, short: str, doc: str, label: str | None = None,
                     values: tuple[str, ...] = ()) -> None:
        self._add_metric(self._counter_cls, short, doc, label, values)

    def _add_metric(self, cls: type, short: str, doc: str, label: str | None,
                    values: tuple[str, ...], **kwargs: Any) -> None:
        extra = [label] if label else []
        parent = cls(name=f"vllm:kv_offload_{short}", documentation=doc,
                     labelnames=self._labelnames + extra, **kwargs)
        self._children[short] = {
            (engine, value): parent.labels(*engine_values, *([value] if label else []))
            for engine, engine_values in self.per_engine_labelvalues.items()
            for value in (values if label else (None,))
        }

    def _inc(self, short: str, engine_idx: int, amount: int | float,
             label: str | None = None) -> None:
        if amount:  # Ray's counter ignores 0 too; skipping keeps both the same
            self._children[short][(engine_idx, label)].inc(amount)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one step's counters; set a tier's gauges when the step reported them."""
        stats = build_stats(transfer_stats_data)
        for tier in TIERS:
            self._inc("hit_tokens", engine_idx, stats.count(f"hit_tokens_{tier}"), tier)
            for suffix in ("used", "total"):
                value = stats.usage(f"{tier}_bytes_{suffix}")
                if value is not None:
                    self._children[f"tier_bytes_{suffix}"][(engine_idx, tier)].set(value)
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


def build_prom_metrics(
    vllm_config: VllmConfig,
    metric_types: dict[type, type],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> KVOffloadPromMetrics:
    """What the connector's `build_prom_metrics` classmethod returns."""
    return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = [
    "COUNTERS", "DIRECTIONS", "GAUGES", "TIERS", "KVOffloadPromMetrics", "KVOffloadStats",
    "build_prom_metrics", "build_stats", "gauge_sum",
]
