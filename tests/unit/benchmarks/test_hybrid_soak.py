"""The ideal cache that benchmarks/bench_hybrid_soak.py measures tier hits against: checked
against an exhaustive search over every choice of what to keep, and the key counts of a
servable prefix against the hit rules."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_offload import FullAttentionSpec, SlidingWindowSpec, find_longest_cache_hit

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import bench_hybrid_soak as soak  # noqa: E402

BS = soak.BLOCK_SIZE
DOC_BLOCKS = 3


def trace_of(rounds: list[list[int]]) -> list[soak.Request]:
    """Documents of DOC_BLOCKS blocks (distinct tokens), each request with a tail of 5."""
    return [soak.Request(r, d, tuple(range(d * 1000, d * 1000 + DOC_BLOCKS * BS))
                         + tuple(range(7, 12)))
            for r, docs in enumerate(rounds) for d in docs]


def exhaustive_best(rounds: list[list[int]], capacity_units: int) -> int:
    """The most tier hits (the first request of a held document in a round: the engine's
    own cache serves the others) of any sequence of choices, by plain recursion."""
    def best(r: int, held: frozenset) -> int:
        if r == len(rounds):
            return 0
        hits = len(held & set(rounds[r]))
        pool = sorted(held | set(rounds[r]))
        return hits + max(best(r + 1, frozenset(keep))
                          for k in range(min(capacity_units, len(pool)) + 1)
                          for keep in itertools.combinations(pool, k))
    return best(0, frozenset())


def without_of(trace: list[soak.Request]) -> list[int]:
    """The engine's own cache in a round: every request of a document after its first."""
    seen, out = set(), []
    for q in trace:
        out.append(DOC_BLOCKS * BS if (q.round, q.document) in seen else 0)
        seen.add((q.round, q.document))
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1,
                max_size=5), st.integers(0, 3))
def test_the_ideal_serves_as_many_tier_hits_as_an_exhaustive_search(rounds, capacity_units):
    trace = trace_of(rounds)
    without = without_of(trace)
    served = soak.ideal_cached(trace, without, capacity_units, DOC_BLOCKS * BS)
    assert set(served) <= {0, DOC_BLOCKS * BS}
    tier_hits = sum(max(0, a - b) for a, b in zip(served, without))
    assert tier_hits == exhaustive_best(rounds, capacity_units) * DOC_BLOCKS * BS


def test_a_servable_prefix_holds_the_keys_the_hit_rules_load():
    """keys_for(n) = what find_longest_cache_hit loads for a hit of n blocks, on the
    benchmark's Gemma3-like groups (one full, two sliding over 128 tokens)."""
    geo = soak.geometry("gemma3")
    attn = dict(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    specs = [FullAttentionSpec(**attn), SlidingWindowSpec(**attn, sliding_window=soak.WINDOW),
             SlidingWindowSpec(**attn, sliding_window=soak.WINDOW)]
    for blocks in (1, 3, 4, 5, 21):
        hit = find_longest_cache_hit(specs, lambda g, i: True, blocks * BS)
        assert hit.num_tokens == blocks * BS
        assert sum(len(b) for b in hit.blocks) == geo.keys_for(blocks)
    assert soak.geometry("llama").keys_for(21) == 21
