"""How long canonicalize() takes on large hybrid models (goal: < 50 ms for 128 layers).

Builds Qwen3-Next-style hybrids (3 Mamba : 1 attention, pages unified, kernel
blocks) and Gemma3-style full + sliding models with 128 layers, allocated the
way vLLM 0.32 does, and times canonicalize() (median of repeats).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kv_offload import FullAttentionSpec, MambaSpec, SlidingWindowSpec, canonicalize
from kv_offload.testing.engine_alloc import allocate_kv_caches
from kv_offload.testing.example_models import group_layers


def hybrid_mamba(num_layers: int):
    attn = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(64, ((3, 256), (4, 32, 32)), (torch.bfloat16, torch.bfloat16),
                      page_size_padded=attn.page_size_bytes)
    return group_layers({f"l{i}": attn if i % 4 == 3 else mamba for i in range(num_layers)}), 32


def hybrid_sliding(num_layers: int):
    common = dict(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    full, local = FullAttentionSpec(**common), SlidingWindowSpec(**common, sliding_window=1024)
    return group_layers({f"l{i}": full if i % 6 == 5 else local for i in range(num_layers)}), None


CASES = {"attention+mamba": hybrid_mamba, "full+sliding": hybrid_sliding}


def measure(case: str, num_layers: int, layout: str, num_blocks: int, repeats: int) -> dict:
    groups, kernel = CASES[case](num_layers)
    kernels = [None if isinstance(g.spec, MambaSpec) else kernel for g in groups]
    _, caches = allocate_kv_caches(groups, num_blocks, layout, kernels)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        canonical = canonicalize(caches, groups, num_blocks)
        times.append(time.perf_counter() - start)
    return {
        "case": case, "layers": num_layers, "layout": layout, "groups": len(groups),
        "unique_tensors": len(canonical.tensors), "num_blocks": num_blocks,
        "median_ms": statistics.median(times) * 1e3, "max_ms": max(times) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=128)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default="bench-canonicalize.json")
    args = parser.parse_args()
    rows = [measure(case, args.layers, layout, args.num_blocks, args.repeats)
            for case in CASES for layout in ("LBNHC", "LBHNC", "BLNHC")]
    print(f"{'case':<16} {'layout':<6} {'layers':>6} {'groups':>6} {'tensors':>7} "
          f"{'median ms':>10} {'max ms':>8}")
    for r in rows:
        print(f"{r['case']:<16} {r['layout']:<6} {r['layers']:>6} {r['groups']:>6} "
              f"{r['unique_tensors']:>7} {r['median_ms']:>10.2f} {r['max_ms']:>8.2f}")
    worst = max(r["median_ms"] for r in rows)
    print(f"worst median: {worst:.2f} ms (goal < 50 ms)")
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "worst_median_ms": worst, "goal_ms": 50}, f, indent=2)


if __name__ == "__main__":
    main()
