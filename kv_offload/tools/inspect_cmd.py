"""`kv-offload inspect`: canonicalise the example models and show what would be offloaded."""

from __future__ import annotations

import argparse
import json
import time

from kv_offload.canonical import canonicalize
from kv_offload.testing.engine_alloc import LAYOUTS
from kv_offload.testing.example_models import EXAMPLE_MODELS, build_example


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(EXAMPLE_MODELS), action="append",
                        help="example model to inspect (repeatable; default: all)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="LBNHC",
                        help="engine KV-cache layout to allocate (default LBNHC)")
    parser.add_argument("--num-blocks", type=int, default=4,
                        help="blocks to allocate per layer (default 4)")
    parser.add_argument("--json", metavar="PATH", help="also write the tables as JSON")


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GiB"


def inspect_model(name: str, layout: str, num_blocks: int) -> dict:
    """Canonicalise one example model; return its groups, tensors and sizes."""
    model = build_example(name, num_blocks, layout=layout)
    start = time.perf_counter()
    canonical = canonicalize(model.kv_caches, model.groups, model.num_blocks)
    seconds = time.perf_counter() - start
    groups = [
        {
            "group": g,
            "spec": type(group.spec).__name__,
            "block_size": group.spec.block_size,
            "layers": len(group.layer_names),
            "refs": len(canonical.group_refs[g]),
            "data_bytes_per_block": canonical.data_bytes_per_block(g),
            "slot_bytes_per_block": canonical.slot_bytes_per_block(g),
        }
        for g, group in enumerate(model.groups)
    ]
    return {
        "model": name,
        "layout": layout,
        "unique_tensors": len(canonical.tensors),
        "page_sizes": sorted({t.page_size_bytes for t in canonical.tensors}),
        "canonicalize_ms": seconds * 1e3,
        "groups": groups,
    }


def print_report(report: dict) -> None:
    pages = ", ".join(_size(p) for p in report["page_sizes"])
    print(f"\n{report['model']} ({report['layout']}): {report['unique_tensors']} unique tensors, "
          f"pages {pages}, canonicalised in {report['canonicalize_ms']:.1f} ms")
    header = f"  {'group':>5}  {'spec':<22} {'block':>6} {'layers':>6} {'refs':>5} " \
             f"{'data/block':>12} {'slot/block':>12}"
    print(header)
    for g in report["groups"]:
        print(f"  {g['group']:>5}  {g['spec']:<22} {g['block_size']:>6} {g['layers']:>6} "
              f"{g['refs']:>5} {_size(g['data_bytes_per_block']):>12} "
              f"{_size(g['slot_bytes_per_block']):>12}")


def run_inspect(args: argparse.Namespace) -> int:
    reports = [inspect_model(name, args.layout, args.num_blocks)
               for name in (args.model or list(EXAMPLE_MODELS))]
    for report in reports:
        print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)
    return 0
