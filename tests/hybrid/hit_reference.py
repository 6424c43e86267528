"""Spec builders and the reference hit definition shared by the hybrid tests.

The acceptance rules here are written from the definitions (DESIGN.md §4), not
by calling the library's rules, so a wrong rule and a wrong search both show.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from kv_offload import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

ATTN = dict(num_kv_heads=1, head_size=8, dtype=torch.float16)


def full(bs: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, **ATTN)


def swa(bs: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, sliding_window=window, **ATTN)


def chunked(bs: int, chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=chunk, **ATTN)


def mamba(bs: int) -> MambaSpec:
    return MambaSpec(block_size=bs, shapes=((2, 3),), dtypes=(torch.float16,))


def cross(bs: int) -> CrossAttentionSpec:
    return CrossAttentionSpec(block_size=bs, **ATTN)


# --- the reference: which blocks a hit of n blocks needs, from the definitions ---

def needed_blocks(spec, n: int) -> list[int]:
    """Blocks a layer must have back to skip its first n blocks (None: never)."""
    bs = spec.block_size
    if isinstance(spec, CrossAttentionSpec):
        return [] if n == 0 else None
    if isinstance(spec, SlidingWindowSpec):
        # the next token at position n*bs sees tokens (n*bs - w, n*bs): w - 1 tokens back
        first_token = max(0, n * bs - (spec.sliding_window - 1))
        return list(range(first_token // bs, n))
    if isinstance(spec, ChunkedLocalAttentionSpec):
        chunk_start = (n * bs) // spec.attention_chunk_size * spec.attention_chunk_size
        return list(range(chunk_start // bs, n))
    if isinstance(spec, MambaSpec):
        return [n - 1] if n else []
    assert isinstance(spec, FullAttentionSpec)  # MLA, sink, SWA-as-full included
    return list(range(n))


@st.composite
def group_specs(draw):
    bs = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    kind = draw(st.sampled_from(
        ["full", "swa", "swa", "chunked", "mamba", "mamba", "cross", "mla", "sink", "full_sw"]))
    if kind == "swa":
        return swa(bs, draw(st.integers(1, 40)))
    if kind == "chunked":  # vLLM requires chunk % block_size == 0
        return chunked(bs, bs * draw(st.integers(1, 5)))
    if kind == "mamba":
        return mamba(bs)
    if kind == "cross":
        return cross(bs)
    if kind == "mla":
        return MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float16)
    if kind == "sink":
        return SinkFullAttentionSpec(block_size=bs, sink_len=4, **ATTN)
    if kind == "full_sw":  # the engine allocates every block: full-attention hits
        return FullAttentionSpec(block_size=bs, sliding_window=8, **ATTN)
    return full(bs)
