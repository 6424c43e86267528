"""`kv-offload inspect`: canonicalise the example models and show what would be offloaded.

One table per model (`report.Table`); ``--json`` writes the `report` envelope whose
``results`` lists one report per model."""

from __future__ import annotations

import argparse
import time

from kv_offload.canonical import canonicalize
from kv_offload.config import format_size
from kv_offload.testing.engine_alloc import LAYOUTS
from kv_offload.testing.example_models import EXAMPLE_MODELS, build_example
from kv_offload.tools.report import Table, emit, envelope, output_path, positive_int


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(EXAMPLE_MODELS), action="append",
                        help="example model to inspect (repeatable; default: all)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="LBNHC",
                        help="engine KV-cache layout to allocate (default LBNHC)")
    parser.add_argument("--num-blocks", type=positive_int, default=4,
                        help="blocks to allocate per layer (default 4)")
    parser.add_argument("--json", metavar="PATH", type=output_path,
                        help="also write the tables as JSON ('-': stdout)")


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


def inspect_table(report: dict) -> Table:
    pages = ", ".join(format_size(p) for p in report["page_sizes"])
    table = Table(f"{report['model']} ({report['layout']}): {report['unique_tensors']} unique "
                  f"tensors, pages {pages}, canonicalised in "
                  f"{report['canonicalize_ms']:.1f} ms",
                  ("group", "spec", "block", "layers", "refs", "data/block", "slot/block"))
    for g in report["groups"]:
        table.add(g["group"], g["spec"], g["block_size"], g["layers"], g["refs"],
                  format_size(g["data_bytes_per_block"]), format_size(g["slot_bytes_per_block"]))
    return table


def run_inspect(args: argparse.Namespace) -> int:
    """Exit status 0; a model that cannot be canonicalised raises its typed error."""
    reports = [inspect_model(name, args.layout, args.num_blocks)
               for name in (args.model or list(EXAMPLE_MODELS))]
    emit([inspect_table(r) for r in reports], envelope("inspect", reports), args.json)
    return 0
