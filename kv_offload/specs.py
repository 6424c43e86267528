"""KV-cache spec types: what one layer stores per block, and how big a page is.

Engine-agnostic frozen dataclasses that use vLLM's field names, so a vLLM spec
translates field by field. A *page* is the bytes one layer keeps for one block;
`real_page_size_bytes` is what carries data, `page_size_bytes` the slot it
occupies (larger when `page_size_padded` is set, e.g. hybrid models that pad
Mamba pages up to the attention page).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import prod

import torch

from kv_offload.errors import SpecError, SpecMergeError


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype."""
    if not isinstance(dtype, torch.dtype):
        raise SpecError(f"dtype must be a torch.dtype, got {dtype!r}")
    return dtype.itemsize


def _require_positive(spec: object, *names: str) -> None:
    for name in names:
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise SpecError(
                f"{type(spec).__name__}.{name} must be a positive int, got {value!r}"
            )


def _check_padding(spec: KVCacheSpec, padded: int | None) -> None:
    if padded is None:
        return
    real = spec.real_page_size_bytes
    if not isinstance(padded, int) or padded < real:
        raise SpecError(
            f"{type(spec).__name__}.page_size_padded={padded!r} is smaller than the real "
            f"page size {real} bytes; padding can only grow a page"
        )


@dataclass(frozen=True)
class KVCacheSpec:
    """Base class: the cache format of one layer, `block_size` tokens per block."""

    block_size: int

    def __post_init__(self) -> None:
        _require_positive(self, "block_size")

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one block that carry data."""
        raise NotImplementedError(f"{type(self).__name__} does not define its page size")

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block occupies (the padded page when padding is set)."""
        return self.real_page_size_bytes

    @property
    def prefix_replay_tokens(self) -> int:
        """Tokens at the end of a prefix hit that the engine recomputes for this layer
        instead of reading them back (vLLM's name; only a bounded-replay
        `SlidingWindowMLASpec` has any): such a layer is never stored nor loaded."""
        return 0

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
        """One spec for a group: all layers of a group must agree exactly."""
        first = _first_of(cls, specs)
        for index, spec in enumerate(specs[1:], start=1):
            _require_same(first, spec, index, [f.name for f in dataclasses.fields(first)])
        return first


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """K and V (`head_size_v`, default `head_size`) for every token of a block."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    head_size_v: int | None = None
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        _require_positive(self, "num_kv_heads", "head_size")
        if not isinstance(self.head_size_v, int) or self.head_size_v < 0:
            raise SpecError(f"{type(self).__name__}.head_size_v must be an int >= 0")
        dtype_size(self.dtype)
        _check_padding(self, self.page_size_padded)

    @property
    def real_page_size_bytes(self) -> int:
        per_token = self.num_kv_heads * (self.head_size + self.head_size_v)
        return self.block_size * per_token * dtype_size(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.real_page_size_bytes


# Fields every layer of an attention group must share exactly.
_ATTENTION_FIELDS = [f.name for f in dataclasses.fields(AttentionSpec)]


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every token stays cached. `sliding_window` / `attention_chunk_size` record a
    local-attention layer that the engine allocates like full attention."""

    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window is not None and self.attention_chunk_size is not None:
            raise SpecError(
                f"{type(self).__name__} cannot have both sliding_window and attention_chunk_size"
            )

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
        """Layers agree on the attention fields; window sizes may be unset on some."""
        first = _first_of(cls, specs)
        for index, spec in enumerate(specs[1:], start=1):
            _require_same(first, spec, index, _ATTENTION_FIELDS)
        windows = _merged_value(specs, "sliding_window")
        chunks = _merged_value(specs, "attention_chunk_size")
        return dataclasses.replace(first, sliding_window=windows, attention_chunk_size=chunks)


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent row of `head_size` per token, no V."""

    head_size_v: int | None = 0


@dataclass(frozen=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with `sink_len` learned sink tokens."""

    sink_len: int | None = None


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Only the last `sliding_window` tokens are attended."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive(self, "sliding_window")


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """A sliding window over MLA latents (DeepSeek-V4): one latent row of `head_size` per
    token, no V. With `bounded_replay` (DeepSeek-V4.1, vLLM 0.33) the engine rebuilds the
    window itself after a prefix hit by recomputing the hit's last `sliding_window`
    tokens, so the layer's blocks are never stored nor loaded (`prefix_replay_tokens`)."""

    head_size_v: int | None = 0
    bounded_replay: bool = False

    @property
    def prefix_replay_tokens(self) -> int:
        return self.sliding_window if self.bounded_replay else 0


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Tokens attend within their chunk of `attention_chunk_size` tokens."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive(self, "attention_chunk_size")
        # Chunks must start on block boundaries, or a hit would need half a block.
        if self.attention_chunk_size % self.block_size:
            raise SpecError(
                f"ChunkedLocalAttentionSpec.attention_chunk_size={self.attention_chunk_size} "
                f"must be a multiple of block_size={self.block_size}"
            )


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Encoder states read by a decoder; never reusable as a prompt prefix."""


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """Recurrent state (e.g. conv + SSM): one tensor per entry of `shapes`/`dtypes`,
    stored back to back at the start of the page."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    num_speculative_blocks: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        shapes = tuple(tuple(int(d) for d in shape) for shape in self.shapes)
        dtypes = tuple(self.dtypes)
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)
        if not shapes or len(shapes) != len(dtypes):
            raise SpecError(
                f"MambaSpec needs one dtype per state shape, got {len(shapes)} shapes "
                f"and {len(dtypes)} dtypes"
            )
        if any(d <= 0 for shape in shapes for d in shape):
            raise SpecError(f"MambaSpec state shapes must be positive, got {shapes}")
        for dtype in dtypes:
            dtype_size(dtype)
        _check_padding(self, self.page_size_padded)

    @property
    def state_sizes_bytes(self) -> tuple[int, ...]:
        """Bytes of each state tensor, in page order."""
        return tuple(prod(s) * dtype_size(d) for s, d in zip(self.shapes, self.dtypes))

    @property
    def real_page_size_bytes(self) -> int:
        return sum(self.state_sizes_bytes)

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.real_page_size_bytes


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """One group whose layers share a spec *type* but not its sizes (e.g. layers
    with different head counts). `kv_cache_specs` maps layer name -> spec."""

    kv_cache_specs: Mapping[str, KVCacheSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.kv_cache_specs:
            raise SpecError("UniformTypeKVCacheSpecs needs at least one layer spec")
        for name, spec in self.kv_cache_specs.items():
            if spec.block_size != self.block_size:
                raise SpecError(
                    f"UniformTypeKVCacheSpecs: layer {name!r} has block_size "
                    f"{spec.block_size}, the group has {self.block_size}"
                )

    def spec_for(self, layer_name: str) -> KVCacheSpec:
        try:
            return self.kv_cache_specs[layer_name]
        except KeyError:
            raise SpecError(
                f"UniformTypeKVCacheSpecs has no spec for layer {layer_name!r}; "
                f"known layers: {sorted(self.kv_cache_specs)}"
            ) from None

    @property
    def real_page_size_bytes(self) -> int:
        return sum(s.real_page_size_bytes for s in self.kv_cache_specs.values())

    @property
    def prefix_replay_tokens(self) -> int:
        return max(s.prefix_replay_tokens for s in self.kv_cache_specs.values())

    @property
    def page_size_bytes(self) -> int:
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())

    def __hash__(self) -> int:
        return hash((self.block_size, tuple(self.kv_cache_specs.items())))


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (and therefore one block id space)."""

    layer_names: list[str]
    spec: KVCacheSpec

    def layer_spec(self, layer_name: str) -> KVCacheSpec:
        """The spec of one layer: the group spec, or its entry in a uniform group."""
        if isinstance(self.spec, UniformTypeKVCacheSpecs):
            return self.spec.spec_for(layer_name)
        return self.spec


def _first_of(cls: type, specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
    if not specs:
        raise SpecMergeError(f"{cls.__name__}.merge needs at least one spec")
    for index, spec in enumerate(specs):
        if not isinstance(spec, cls):
            raise SpecMergeError(
                f"{cls.__name__}.merge: spec {index} is a {type(spec).__name__}; all layers "
                f"of one group must be {cls.__name__}"
            )
    if len({type(spec) for spec in specs}) > 1:
        kinds = sorted({type(spec).__name__ for spec in specs})
        raise SpecMergeError(f"layers of one group mix spec types {kinds}")
    return specs[0]


def _require_same(first: KVCacheSpec, other: KVCacheSpec, index: int, names: list[str]) -> None:
    differing = [n for n in names if getattr(first, n) != getattr(other, n)]
    if differing:
        detail = ", ".join(
            f"{n}: {getattr(first, n)!r} vs {getattr(other, n)!r}" for n in differing
        )
        raise SpecMergeError(
            f"layers of one group must share their {type(first).__name__}; spec {index} "
            f"differs from spec 0 in {detail}"
        )


def _merged_value(specs: Sequence[KVCacheSpec], name: str) -> int | None:
    values = {getattr(s, name) for s in specs} - {None}
    if len(values) > 1:
        raise SpecMergeError(
            f"layers of one group must share one {name}, got {sorted(values)}"
        )
    return values.pop() if values else None
