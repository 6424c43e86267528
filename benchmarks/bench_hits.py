"""Time find_longest_cache_hit on a 128k-token prompt over several hybrid models.

For each model and cache state it reports the median and p90 time of one lookup
(over many repeats), how many `is_cached` calls one lookup makes, and the time
of a plain loop making one `is_cached` call per block of every group (the cost
of a scan that looks at everything once), and the lookup's calls times the cost
of one call measured by that loop: the part of a lookup spent in `is_cached`.
`is_cached` looks (block hash, group) keys up in a set; the last column times
the same lookup answered by a real OffloadManager (`is_ready`).

    python benchmarks/bench_hits.py --json bench_hits.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from functools import partial

import torch

from kv_offload import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    find_longest_cache_hit,
)
from kv_offload.store.manager import OffloadManager
from kv_offload.testing.example_models import gemma3, group_layers, qwen3_next

PROMPT_TOKENS = 128 * 1024
MAX_LENGTH = PROMPT_TOKENS - 1  # vLLM always computes the last prompt token
ATTN = dict(num_kv_heads=8, head_size=128, dtype=torch.bfloat16)


def mixed_four() -> list[KVCacheSpec]:
    """Full attention, two sliding windows (16-token blocks) and a Mamba group of 544."""
    return [
        FullAttentionSpec(block_size=16, **ATTN),
        SlidingWindowSpec(block_size=16, sliding_window=1024, **ATTN),
        SlidingWindowSpec(block_size=16, sliding_window=4096, **ATTN),
        MambaSpec(block_size=544, shapes=((3, 8192), (32, 128, 128)),
                  dtypes=(torch.bfloat16, torch.bfloat16)),
    ]


MODELS = {
    "mixed-4 (full16, swa1k, swa4k, mamba544)": mixed_four,
    "gemma3 (groups of the real model)": lambda: [g.spec for g in group_layers(gemma3())],
    "qwen3-next (groups of the real model)": lambda: [g.spec for g in group_layers(qwen3_next())],
}


def cache_states(specs: list[KVCacheSpec], rng: random.Random) -> dict[str, list[set[int]]]:
    counts = [PROMPT_TOKENS // s.block_size for s in specs]
    return {
        "all cached": [set(range(n)) for n in counts],
        "first half cached": [set(range(n // 2)) for n in counts],
        "1% holes": [{i for i in range(n) if rng.random() >= 0.01} for n in counts],
        "nothing cached": [set() for _ in counts],
    }


def make_is_cached(specs: list[KVCacheSpec], cached: list[set[int]], rng: random.Random):
    """Two `is_cached` over the same keys: a plain set, and a real OffloadManager."""
    hashes = [[rng.randbytes(16) for _ in range(PROMPT_TOKENS // s.block_size)] for s in specs]
    keys = [(hashes[g][i], g) for g, blocks in enumerate(cached) for i in sorted(blocks)]
    store = set(keys)
    manager = OffloadManager(max(1, len(keys)), "lru")
    plan = manager.prepare_store(keys)
    manager.complete_store(list(plan.keys), True)
    is_ready = manager.is_ready

    def in_set(g: int, i: int) -> bool:
        return (hashes[g][i], g) in store

    def in_manager(g: int, i: int) -> bool:
        return is_ready((hashes[g][i], g))

    return in_set, in_manager


def time_calls(fn, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return samples


def counted(is_cached, calls: list[tuple[int, int]], g: int, i: int) -> bool:
    calls.append((g, i))
    return is_cached(g, i)


def scan_all(specs: list[KVCacheSpec], is_cached) -> None:
    for g, spec in enumerate(specs):
        for i in range(MAX_LENGTH // spec.block_size):
            is_cached(g, i)


def run(repeats: int) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for model, make_specs in MODELS.items():
        specs = make_specs()
        for state, cached in cache_states(specs, rng).items():
            is_cached, via_manager = make_is_cached(specs, cached, rng)
            calls: list[tuple[int, int]] = []
            hit = find_longest_cache_hit(specs, partial(counted, is_cached, calls), MAX_LENGTH)
            lookup = partial(find_longest_cache_hit, specs, is_cached, MAX_LENGTH)
            lookup()  # warm up
            samples = time_calls(lookup, repeats)
            managed = time_calls(
                partial(find_longest_cache_hit, specs, via_manager, MAX_LENGTH), repeats)
            floor = statistics.median(
                time_calls(partial(scan_all, specs, is_cached), max(5, repeats // 10)))
            call_us = floor / sum(MAX_LENGTH // s.block_size for s in specs)
            rows.append({
                "model": model,
                "cache": state,
                "block_sizes": [s.block_size for s in specs],
                "hit_tokens": hit.num_tokens,
                "blocks_to_load": [len(b) for b in hit.blocks],
                "is_cached_calls": len(calls),
                "lookup_median_us": statistics.median(samples),
                "lookup_p90_us": statistics.quantiles(samples, n=10)[-1],
                "lookup_via_manager_median_us": statistics.median(managed),
                "scan_every_block_once_us": floor,
                "is_cached_call_us": call_us,
                "calls_times_call_cost_us": len(calls) * call_us,
            })
    return rows


def print_table(rows: list[dict]) -> None:
    header = (f"{'model':42} {'cache':18} {'hit':>7} {'calls':>6} {'median us':>10} "
              f"{'p90 us':>8} {'calls x cost':>12} {'scan-all us':>11} {'via manager':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['model']:42} {r['cache']:18} {r['hit_tokens']:>7} {r['is_cached_calls']:>6} "
              f"{r['lookup_median_us']:>10.1f} {r['lookup_p90_us']:>8.1f} "
              f"{r['calls_times_call_cost_us']:>12.1f} {r['scan_every_block_once_us']:>11.1f} "
              f"{r['lookup_via_manager_median_us']:>11.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--repeats", type=int, default=300, help="lookups timed per case")
    args = parser.parse_args()
    rows = run(args.repeats)
    print(f"prompt {PROMPT_TOKENS} tokens, max_length {MAX_LENGTH}, "
          f"{args.repeats} lookups per case")
    print_table(rows)
    if args.json:
        meta = {"python": platform.python_version(), "cpus": os.cpu_count(),
                "prompt_tokens": PROMPT_TOKENS, "repeats": args.repeats}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
