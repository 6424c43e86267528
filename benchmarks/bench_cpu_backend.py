"""Sweep `kv-offload bench --backend cpu` over page sizes and the example models.

Prints one table and writes all results as a JSON list. Each row is measured
side by side with its own baseline (one torch copy of the same bytes).

    python benchmarks/bench_cpu_backend.py --json /tmp/bench_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys

from kv_offload.tools.bench import add_bench_arguments, bench_cpu

CASES = [
    ["--page-kib", "2"],
    ["--page-kib", "2", "--layers", "32"],
    ["--page-kib", "16"],
    ["--page-kib", "256"],
    ["--page-kib", "2048"],
    ["--page-kib", "16", "--pattern", "scattered"],
    ["--model", "llama-8b"],
    ["--model", "llama-8b", "--layout", "BLNHC"],
    ["--model", "gemma3"],
    ["--model", "qwen3-next"],
    ["--model", "deepseek-mla"],
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--repeats", default="5")
    parser.add_argument("--batch-mib", default="256")
    args = parser.parse_args(argv)
    results = []
    for case in CASES:
        case_parser = argparse.ArgumentParser()
        add_bench_arguments(case_parser)
        case_args = case_parser.parse_args(
            case + ["--repeats", args.repeats, "--batch-mib", args.batch_mib])
        results.append(bench_cpu(case_args))
    print(f"{'case':34}{'page B':>9}{'blocks':>8}{'base':>7}{'store':>7}{'load':>7}"
          f"{'st/b':>6}{'ld/b':>6}{'bad':>5}  strategies (store/load)")
    for r in results:
        label = f"{r['model']} {r['layout']} {r['pattern']}"
        strategies = f"{','.join(r['strategies']['store'])}/{','.join(r['strategies']['load'])}"
        print(f"{label:34}{r['page_bytes']:9d}{r['blocks']:8d}{r['baseline_gbps']:7.2f}"
              f"{r['store_gbps']:7.2f}{r['load_gbps']:7.2f}{r['store_ratio']:6.2f}"
              f"{r['load_ratio']:6.2f}{r['mismatches']:5d}  {strategies}")
    print("GB/s, best of the repeats; st/b and ld/b: ratio to the baseline of the same row")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all(r["mismatches"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
