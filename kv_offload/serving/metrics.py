"""What a vLLM server's Prometheus endpoint (`GET /metrics`) says about the KV cache.

The connector's counters (`vllm:kv_offload_*`, defined in `kv_offload.vllm.stats`) and two
of vLLM's own are read from the text exposition with prometheus_client's parser and summed
over every label except the ones that split them (`tier`, `direction`; every tier but the
host tier is the storage tier, labelled by its name: `disk`, `valkey`...): a server with
several engines (data parallelism) reports one series per engine, and a client sees their
sum.

This module never imports vLLM: `kv-offload serve-check` runs on any machine that can reach
the server. The metric names below must match `KVOffloadPromMetrics`; the end-to-end tests
read them from a real server, so a rename there fails here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

OFFLOAD_PREFIX = "vllm:kv_offload_"
# Sample names as exposed: prometheus_client appends `_total` to counters.
_HIT_TOKENS = OFFLOAD_PREFIX + "hit_tokens_total"
_QUERY_TOKENS = OFFLOAD_PREFIX + "query_tokens_total"
_LOADED_BYTES = OFFLOAD_PREFIX + "loaded_bytes_total"
_STORED_BYTES = OFFLOAD_PREFIX + "stored_bytes_total"
_FAILED_BLOCKS = OFFLOAD_PREFIX + "failed_blocks_total"
# vLLM's own offloading connectors also name their metrics `vllm:kv_offload_*`: a server runs
# ours when it exposes this one, which only KVOffloadConnector has.
OURS = OFFLOAD_PREFIX + "faults_total"
# vLLM's own: tokens served from its prefix cache, and from a connector ("external").
_LOCAL_HITS = "vllm:prefix_cache_hits_total"
_EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
_CACHE_CONFIG = "vllm:cache_config_info"


@dataclass(frozen=True)
class OffloadCounters:
    """The connector's counters at one moment (or the difference of two moments)."""

    hit_tokens_host: float = 0.0
    hit_tokens_storage: float = 0.0
    """Hit tokens of the storage tier (``ServerMetrics.storage_tier`` names it)."""
    query_tokens: float = 0.0
    loaded_bytes: float = 0.0
    stored_bytes: float = 0.0
    failed_load_blocks: float = 0.0
    failed_store_blocks: float = 0.0

    @property
    def hit_tokens(self) -> float:
        """Tokens the connector promised to load, from any tier."""
        return self.hit_tokens_host + self.hit_tokens_storage

    def since(self, earlier: OffloadCounters) -> OffloadCounters:
        """What happened between `earlier` and this snapshot."""
        return OffloadCounters(**{
            f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)
        })


@dataclass(frozen=True)
class ServerMetrics:
    """One scrape of `/metrics`, reduced to what the serving checks need."""

    offload: OffloadCounters | None
    """None when the server exposes no `vllm:kv_offload_*` metric (connector not loaded)."""
    local_hit_tokens: float
    """Prompt tokens served from vLLM's own prefix cache."""
    external_hit_tokens: float
    """Prompt tokens vLLM took from a KV connector."""
    block_size: int | None
    """vLLM's block size, from `vllm:cache_config_info` (None if absent)."""
    prefix_caching: bool | None
    """Whether vLLM's prefix caching is on, from the same info metric."""
    storage_tier: str | None = None
    """The storage tier's label in the connector's metrics (``disk``, ``valkey``, ``s3``, a
    plug-in's name), None when the server has none."""


def parse_metrics(text: str) -> ServerMetrics:
    """Reduce a Prometheus text exposition to `ServerMetrics`."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[tuple[str, str | None], float] = {}
    storage_tiers: set[str] = set()
    seen_offload = False
    block_size: int | None = None
    prefix_caching: bool | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == OURS:
                seen_offload = True
            if sample.name == _CACHE_CONFIG:
                block_size = _int_or_none(sample.labels.get("block_size"))
                caching = sample.labels.get("enable_prefix_caching")
                prefix_caching = None if caching is None else caching == "True"
                continue
            split = sample.labels.get("tier") or sample.labels.get("direction")
            if sample.name == _HIT_TOKENS and split not in (None, "host"):
                storage_tiers.add(split)
            key = (sample.name, split)
            sums[key] = sums.get(key, 0.0) + sample.value

    def total(name: str, split: str | None = None) -> float:
        return sums.get((name, split), 0.0)

    offload = None
    if seen_offload:
        offload = OffloadCounters(
            hit_tokens_host=total(_HIT_TOKENS, "host"),
            hit_tokens_storage=sum(total(_HIT_TOKENS, tier) for tier in storage_tiers),
            query_tokens=total(_QUERY_TOKENS),
            loaded_bytes=total(_LOADED_BYTES),
            stored_bytes=total(_STORED_BYTES),
            failed_load_blocks=total(_FAILED_BLOCKS, "load"),
            failed_store_blocks=total(_FAILED_BLOCKS, "store"),
        )
    return ServerMetrics(
        offload=offload,
        local_hit_tokens=total(_LOCAL_HITS),
        external_hit_tokens=total(_EXTERNAL_HITS),
        block_size=block_size,
        prefix_caching=prefix_caching,
        storage_tier=",".join(sorted(storage_tiers)) or None,
    )


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
