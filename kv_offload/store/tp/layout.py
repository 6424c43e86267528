"""One stored unit for every tensor-parallel size: which heads a rank holds, writes and reads.

Why: a page of a rank's engine cache holds only that rank's shard of the KV heads, so a page
stored by a TP=2 server means nothing to a TP=1 or TP=4 server. Keyed by the parallel shape
(what the fingerprint does today) that is never wrong, but a fleet mixing GPU counts keeps one
copy per shape. Here the stored unit is one **KV head of one block of one cache group**: for
every layer of the group (in the group's layer order), that head's `[tokens, K|V]` rows,
token-major. The unit does not depend on the TP size, the rank, the engine's page layout
(LBNHC or LBHNC) or its kernel block size; `kv_offload.store.tp.pages` maps a rank's engine pages to
units and back (pure functions, proven by property tests against engines allocated per rank
as vLLM 0.32 allocates them: `tests/unit/store/tp/test_pages_property.py`).

**vLLM's sharding rule** (0.32: `QKVParallelLinear.__init__` in `model_executor/layers/
linear.py`, the per-model attention classes, `ModelConfig.get_num_kv_heads`). With H KV heads
and TP size T:
- T <= H: H must be divisible by T (vLLM asserts it); rank r holds the H/T consecutive heads
  `[r*H/T, (r+1)*H/T)`.
- T > H: T must be divisible by H (vLLM asserts it); every rank holds one head, the head of
  rank r is `r // (T/H)` (its weights are loaded from shard `tp_rank // num_kv_head_replicas`):
  T/H consecutive ranks hold the same head.
- MLA: `get_num_kv_heads` is 1 at every T: the latent is replicated on every rank, exactly
  the T > H case with H = 1.
Shapes vLLM refuses (H=6 at T=4, H=3 at T=2, H=6 at T=8) are refused here too
(`ConfigError`): there is no vLLM page to map them to.

**Writes and reads** (wired into the connector by `tp.records` / `tp.tier`). The storage tier
holds **records**: a contiguous head range of one block of one group, layer by layer, each
layer's rows in the order the writer's pages have (head-major: the units back to back, as
in an LBHNC page; token-major: the units' rows interleaved per token, as in an LBNHC page), so
a writer at its own TP size stores one record per block and group, as many values as
before, and each is the host slot's own bytes. A rank reads every head it holds. A head is
written by exactly one rank, the first that holds it (`r % replicas == 0`): replicated heads
and MLA latents are stored once, not T/H times. A rank reads its own range's record, else a
larger record containing it, else smaller ones tiling it (`tp.records.GroupRecords.cover`).
A block of a group counts as cached for a rank only when every unit it needs is present
(`units_needed`); a rank never assembles a page from part of its heads (a miss: the engine
recomputes). The host tier stays per rank (rank pages, in-process).

**The math for the example models** (`kv_offload.testing.example_models`). Units per block
and group = H (KV heads; MLA: 1). Per TP size: heads per rank (= units it reads), replicas
per head, and the ranks that write (one record each per block and group; a reader of
another TP size reads the records covering its heads):

| model (H) | TP=1 | TP=2 | TP=4 | TP=8 |
|---|---|---|---|---|
| Llama-3-8B, GQA (8) | 8; x1; r0 | 4; x1; all | 2; x1; all | 1; x1; all |
| Gemma-3-12B, SWA + full groups (8) | 8; x1; r0 | 4; x1; all | 2; x1; all | 1; x1; all |
| DeepSeek-V3, MLA (1 latent) | 1; x1; r0 | 1; x2; r0 | 1; x4; r0 | 1; x8; r0 |
| Qwen3-Next, attention (2) | 2; x1; r0 | 1; x1; all | 1; x2; r0, r2 | 1; x4; r0, r4 |
| Qwen3-Next, GatedDeltaNet | per TP shape | per TP shape | per TP shape | per TP shape |

A Llama-3-8B unit is 32 layers x 16 tokens x 256 values x 2 bytes = 256 KiB: TP=1 writes one
record of units 0..7 (2 MiB) per block, TP=8 rank r a record of unit r, and a TP=2 rank 1
needs units 4..7: its own TP=2 record, else TP=1's record (2 MiB read, half taken), else the
TP=4 records [4, 6) and [6, 8), else the four TP=8 records. Counts that do not
divide: 8 heads at TP=16 (ranks 2h and 2h+1 hold head h) or 2 heads at TP=8 are replicated as
above; 6 heads at TP=4 or 8, or 3 at TP=2, are refused (vLLM refuses them: no such engine).

**Mamba-type groups (GatedDeltaNet, Mamba2, short conv) stay per TP shape.** vLLM shards their
states by heads and channels, but the conv state of a rank is the concatenation of that rank's
slices of several projections (q, k, v / x, B, C), with group replication rules of their own
(`mamba_v2_sharded_weight_loader`), and the state layout depends on the backend. We have not
proven that byte mapping against vLLM, so these groups keep the TP size and rank in their key
(`tp_mode` = `PER_SHAPE`): across TP sizes they miss, never serve wrong bytes. Consequence for
hybrids: a hit needs every group, so a Qwen3-Next prefix stored at TP=2 still misses at TP=1.
Moreover vLLM unifies hybrid page sizes by growing the attention block until its page covers
the per-rank Mamba state, so the attention block size itself changes with TP (Qwen3-Next:
544 tokens at TP 1 and 2, 288 at TP 4, 160 at TP 8): block hashes then differ and units of
different block sizes never match (a miss). Cross-attention groups (never a prefix) and
groups mixing layers of different KV-head counts are per shape too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kv_offload.errors import ConfigError
from kv_offload.specs import (
    AttentionSpec,
    CrossAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
)


class TPMode(enum.Enum):
    """How a cache group's bytes are stored across tensor-parallel sizes."""

    HEADS = "heads"  # one unit per KV head; any TP size assembles its heads
    REPLICATED = "replicated"  # one unit (the MLA latent), written once, read by every rank
    PER_SHAPE = "per_shape"  # keyed by TP size and rank: a miss under any other shape


def tp_mode(spec: KVCacheSpec) -> TPMode:
    """The storage mode of a group with this spec (see the module docstring)."""
    if isinstance(spec, MLAAttentionSpec | SlidingWindowMLASpec):  # (one latent, every rank)
        return TPMode.REPLICATED
    if isinstance(spec, CrossAttentionSpec):
        return TPMode.PER_SHAPE  # encoder states: never a reusable prefix
    if isinstance(spec, AttentionSpec):
        return TPMode.HEADS
    if isinstance(spec, UniformTypeKVCacheSpecs):
        modes = {tp_mode(s) for s in spec.kv_cache_specs.values()}
        heads = {s.num_kv_heads for s in spec.kv_cache_specs.values()
                 if isinstance(s, AttentionSpec)}
        # A unit is "head h of every layer": every layer must have the same head count.
        if len(modes) == 1 and len(heads) == 1:
            return modes.pop()
    return TPMode.PER_SHAPE


@dataclass(frozen=True)
class KVHeadShard:
    """The KV heads one rank holds under vLLM's rule: `[first_head, first_head + num_heads)`
    of `total_heads`, each held by `replicas` consecutive ranks."""

    total_heads: int
    tp_size: int
    rank: int
    first_head: int
    num_heads: int
    replicas: int

    @classmethod
    def of(cls, total_heads: int, tp_size: int, rank: int) -> KVHeadShard:
        """The shard of `rank` (vLLM 0.32's rule); ConfigError for a shape vLLM refuses."""
        for name, value in (("total_heads", total_heads), ("tp_size", tp_size)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"KVHeadShard: {name} must be a positive int, got {value!r}")
        if not isinstance(rank, int) or not 0 <= rank < tp_size:
            raise ConfigError(f"KVHeadShard: rank must be an int in [0, {tp_size}), "
                              f"got {rank!r}")
        if tp_size <= total_heads:
            if total_heads % tp_size:
                raise ConfigError(f"KVHeadShard: {total_heads} KV heads cannot be split over "
                                  f"tensor_parallel_size={tp_size} (vLLM needs the heads "
                                  f"divisible by the TP size)")
            per_rank = total_heads // tp_size
            return cls(total_heads, tp_size, rank, rank * per_rank, per_rank, 1)
        if tp_size % total_heads:
            raise ConfigError(f"KVHeadShard: {total_heads} KV heads cannot be replicated over "
                              f"tensor_parallel_size={tp_size} (vLLM needs the TP size "
                              f"divisible by the heads)")
        replicas = tp_size // total_heads
        return cls(total_heads, tp_size, rank, rank // replicas, 1, replicas)

    @property
    def heads(self) -> range:
        """The global heads this rank holds, in the order of its page's head axis."""
        return range(self.first_head, self.first_head + self.num_heads)

    @property
    def writes(self) -> bool:
        """Whether this rank stores its heads (the first of each head's replicas does)."""
        return self.rank % self.replicas == 0

    def units_needed(self) -> range:
        """The units (global heads) this rank must find to load a block."""
        return self.heads

    def units_written(self) -> range:
        """The units this rank stores: its heads, or none when another replica does."""
        return self.heads if self.writes else range(0)


def group_shard(spec: KVCacheSpec, total_kv_heads: int, tp_size: int,
                rank: int) -> KVHeadShard | None:
    """The shard of a group (None for `PER_SHAPE` groups). `total_kv_heads` is the model's
    KV-head count (ignored for MLA: one replicated latent). The spec's per-rank head count
    must agree with vLLM's rule, or the pages are not what this module assumes."""
    mode = tp_mode(spec)
    if mode is TPMode.PER_SHAPE:
        return None
    shard = KVHeadShard.of(1 if mode is TPMode.REPLICATED else total_kv_heads, tp_size, rank)
    specs = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) \
        else (spec,)
    for layer_spec in specs:
        if layer_spec.num_kv_heads != shard.num_heads:
            raise ConfigError(
                f"a {type(layer_spec).__name__} with num_kv_heads={layer_spec.num_kv_heads} "
                f"on rank {rank} of tensor_parallel_size={tp_size}: vLLM's rule gives "
                f"{shard.num_heads} of {shard.total_heads} KV heads per rank")
    return shard
