"""The Zipf trace and the ideal LRU cache that benchmarks/bench_zipf.py measures against."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_offload import FullAttentionSpec, find_longest_cache_hit

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import zipf_trace  # noqa: E402

BS = 4
WORDS = range(10, 60)


def doc(first: int, blocks: int) -> tuple[int, ...]:
    return tuple(range(first, first + blocks * BS))


def test_a_fully_cached_prompt_of_whole_blocks_is_served_all_but_its_last_block():
    cache = zipf_trace.IdealLRU(10, BS)
    prompt = doc(0, 2)
    assert cache.serve(prompt) == 0
    assert cache.serve(prompt) == BS  # never the last token: block 2 holds it
    assert cache.serve(prompt + (99,)) == 2 * BS


def test_the_hit_stops_at_the_first_missing_block():
    cache = zipf_trace.IdealLRU(3, BS)
    a, b = doc(0, 3), doc(100, 2)
    cache.serve(a + (1,))
    cache.serve(b + (1,))  # 5 blocks into 3: a's two tail blocks go, a's head stays
    assert cache.serve(a + (1,)) == BS


def test_an_eviction_takes_the_least_recent_document_tail_first():
    cache = zipf_trace.IdealLRU(4, BS)
    a, b, c = doc(0, 2), doc(100, 2), doc(200, 1)
    cache.serve(a + (1,))
    cache.serve(b + (1,))
    cache.serve(a + (1,))  # a is now the most recent
    cache.serve(c + (1,))  # one block must go: b's tail
    assert len(cache) == 4
    assert cache.serve(a + (1,)) == 2 * BS
    assert cache.serve(b + (1,)) == BS


def test_a_cache_without_capacity_serves_nothing():
    cache = zipf_trace.IdealLRU(0, BS)
    assert [cache.serve(doc(0, 3) + (1,)) for _ in range(3)] == [0, 0, 0]


@settings(max_examples=200, deadline=None)
@given(cached=st.lists(st.booleans(), min_size=1, max_size=8),
       extra=st.integers(min_value=0, max_value=BS - 1))
def test_the_ideal_hit_rule_agrees_with_full_attention_hits(cached, extra):
    """Plant exactly the blocks in `cached` and compare the ideal cache's hit with
    kv_offload's find_longest_cache_hit for one full-attention group."""
    prompt = doc(0, len(cached)) + tuple(range(1000, 1000 + extra))
    cache = zipf_trace.IdealLRU(100, BS)
    cache.serve(prompt)  # caches every full block; now drop the ones not planted
    for i, keep in enumerate(cached):
        if not keep:
            del cache._blocks[prompt[:(i + 1) * BS]]
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    expected = find_longest_cache_hit(
        [spec], lambda g, i: i < len(cached) and cached[i], len(prompt) - 1).num_tokens
    assert cache.serve(prompt) == expected


def test_rounds_keep_the_trace_order_and_never_repeat_a_document():
    docs = zipf_trace.make_documents(20, 1, 3, BS, WORDS, seed=1)
    trace = zipf_trace.make_trace(docs, 300, 1.0, 2, BS, WORDS, seed=2)
    rounds = zipf_trace.split_rounds(trace, 5)
    assert [r.index for rnd in rounds for r in rnd] == list(range(300))
    for rnd in rounds:
        assert 0 < len(rnd) <= 5
        assert len({r.document for r in rnd}) == len(rnd)
    # a round ends early only where the next request repeats one of its documents
    for rnd, nxt in zip(rounds, rounds[1:]):
        assert len(rnd) == 5 or nxt[0].document in {r.document for r in rnd}


def test_requests_follow_the_zipf_law_and_carry_their_document_and_a_question():
    docs = zipf_trace.make_documents(10, 2, 2, BS, WORDS, seed=3)
    trace = zipf_trace.make_trace(docs, 4000, 1.0, 3, BS, WORDS, seed=4)
    counts = Counter(r.document for r in trace).most_common()
    weights = zipf_trace.zipf_weights(10, 1.0)
    for (_, n), w in zip(counts[:3], weights):
        assert abs(n / 4000 - w) < 0.03
    for r in trace[:50]:
        assert r.prompt[:len(docs[r.document])] == docs[r.document]
        assert len(r.prompt) == len(docs[r.document]) + 3
    again = zipf_trace.make_trace(docs, 4000, 1.0, 3, BS, WORDS, seed=4)
    assert again == trace


def test_documents_share_no_first_block():
    docs = zipf_trace.make_documents(50, 1, 4, BS, WORDS, seed=5)
    assert len({d[:BS] for d in docs}) == 50
    assert all(len(d) % BS == 0 and 1 <= len(d) // BS <= 4 for d in docs)
