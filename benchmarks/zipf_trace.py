"""The Zipf trace of bench_zipf.py and the ideal caches it is measured against.

Contents:
- `make_documents`: N documents, each a seeded random run of whole blocks of word tokens
  (distinct first blocks, so no two documents share a block).
- `make_trace`: requests that pick documents by a seeded Zipf law, each the document plus a
  short question of its own (shorter than a block, so the question never fills a block).
- `split_rounds`: consecutive runs of the trace in which no document appears twice, at most
  `max_round` long (within a round vLLM's own prefix cache can therefore serve nothing).
- `IdealLRU`: an LRU cache of whole blocks that replays the trace with vLLM's hit rule for
  full attention: the hit is the longest prefix of cached whole blocks, never the last
  prompt token. After each request all its full blocks are cached and most recent; the first
  block is the most recent of them (tails go first, as in vLLM's own prefix cache, so an
  eviction never leaves an unreachable tail behind a missing head). `serve` returns the
  tokens this ideal cache serves the request.

Documents share no block, so the order of requests inside a round (vLLM runs them together)
changes no hit, only which blocks an eviction picks first.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: `document` is the index of its shared prefix."""

    index: int
    document: int
    prompt: tuple[int, ...]  # token ids: the document, then the question


def make_documents(num_documents: int, min_blocks: int, max_blocks: int, block_size: int,
                   token_ids: range, seed: int) -> list[tuple[int, ...]]:
    """Documents of `min_blocks..max_blocks` whole blocks of random tokens from `token_ids`."""
    if not 0 < min_blocks <= max_blocks:
        raise ValueError(f"need 0 < min_blocks <= max_blocks, got {min_blocks}, {max_blocks}")
    rng = random.Random(seed)
    docs, first_blocks = [], set()
    for _ in range(num_documents):
        length = rng.randint(min_blocks, max_blocks) * block_size
        doc = tuple(rng.choice(token_ids) for _ in range(length))
        if doc[:block_size] in first_blocks:  # astronomically unlikely; never silently
            raise ValueError("two documents drew the same first block; change the seed")
        first_blocks.add(doc[:block_size])
        docs.append(doc)
    return docs


def zipf_weights(num_documents: int, exponent: float) -> list[float]:
    """P(rank k) proportional to 1 / k**exponent, k = 1..N (normalised)."""
    raw = [1.0 / (k ** exponent) for k in range(1, num_documents + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def make_trace(documents: list[tuple[int, ...]], num_requests: int, exponent: float,
               question_tokens: int, block_size: int, token_ids: range,
               seed: int) -> list[TraceRequest]:
    """`num_requests` requests; document popularity follows Zipf(`exponent`) over a seeded
    random ranking of the documents (so popularity does not follow document length)."""
    if not 0 < question_tokens < block_size:
        raise ValueError(f"question_tokens must be in 1..{block_size - 1} (a question never "
                         f"fills a block), got {question_tokens}")
    rng = random.Random(seed)
    ranking = list(range(len(documents)))
    rng.shuffle(ranking)  # ranking[r] is the document of popularity rank r
    picks = rng.choices(ranking, weights=zipf_weights(len(documents), exponent),
                        k=num_requests)
    return [TraceRequest(i, d, documents[d] + tuple(rng.choice(token_ids)
                                                    for _ in range(question_tokens)))
            for i, d in enumerate(picks)]


def split_rounds(trace: list[TraceRequest], max_round: int) -> list[list[TraceRequest]]:
    """Consecutive runs of the trace, each at most `max_round` long and without a repeated
    document; a run ends where the next request would repeat one of its documents."""
    rounds: list[list[TraceRequest]] = []
    current: list[TraceRequest] = []
    seen: set[int] = set()
    for request in trace:
        if len(current) == max_round or request.document in seen:
            rounds.append(current)
            current, seen = [], set()
        current.append(request)
        seen.add(request.document)
    if current:
        rounds.append(current)
    return rounds


class IdealLRU:
    """An LRU cache of `capacity_blocks` whole blocks (see the module docstring)."""

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[tuple[int, ...], None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._blocks)

    def serve(self, prompt: tuple[int, ...]) -> int:
        """Tokens served from the cache for this prompt; then cache its full blocks."""
        bs = self.block_size
        keys = [prompt[:(i + 1) * bs] for i in range(len(prompt) // bs)]
        hit_blocks = 0
        for key in keys[:(len(prompt) - 1) // bs]:  # never the last token
            if key not in self._blocks:
                break
            hit_blocks += 1
        if self.capacity_blocks:
            for key in reversed(keys[:self.capacity_blocks]):  # block 0 most recent
                self._blocks[key] = None
                self._blocks.move_to_end(key)
            while len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)
        return hit_blocks * bs
