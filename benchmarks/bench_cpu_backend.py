"""Sweep `kv-offload bench --tier host` over page sizes and the example models.

Prints one table and writes all results as a JSON list. Each row is measured
side by side with its own baseline (one torch copy of the same bytes).

    python benchmarks/bench_cpu_backend.py --json /tmp/bench_cpu.json
"""

from __future__ import annotations

import argparse
import sys

from kv_offload.tools.bench import add_bench_arguments, check_bench_arguments
from kv_offload.tools.bench_cpu import bench_cpu
from kv_offload.tools.report import STATISTIC, Table, emit, envelope

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
    parser.add_argument("--json", metavar="PATH", help="the envelope ('-': stdout)")
    parser.add_argument("--repeats", default="5")
    parser.add_argument("--batch-mib", default="256")
    args = parser.parse_args(argv)
    results = []
    for case in CASES:
        case_parser = argparse.ArgumentParser()
        add_bench_arguments(case_parser)
        case_args = case_parser.parse_args(
            case + ["--repeats", args.repeats, "--batch-mib", args.batch_mib])
        check_bench_arguments(case_args)
        results.append(bench_cpu(case_args))
    table = Table("kv-offload bench --tier host, every case: GB/s, best of the repeats; "
                  "ratios to the baseline of the same row",
                  ("case", "page B", "blocks", "base st", "store", "base ld", "load", "st/b",
                   "ld/b", "bad", "strategies (store/load)"))
    for r in results:
        table.add(f"{r['model']} {r['layout']} {r['pattern']}", r["page_bytes"], r["blocks"],
                  r["baseline_store_gbps"], r["store_gbps"], r["baseline_load_gbps"],
                  r["load_gbps"], r["store_ratio"], r["load_ratio"],
                  r["mismatches"] + r["failed_keys"],
                  f"{','.join(r['strategies']['store'])}/{','.join(r['strategies']['load'])}")
    emit([table], envelope("bench_cpu_backend", results, STATISTIC), args.json)
    return 0 if all(r["mismatches"] == 0 and r["failed_keys"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
