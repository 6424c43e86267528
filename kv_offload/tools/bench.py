"""`kv-offload bench`: store/load throughput of a backend, checked byte for byte.

For the CPU backend: build an example model's kv_caches (or a synthetic one
with `--page-kib` pages), canonicalise, then repeat: a baseline (one plain
torch copy of the same number of bytes), a store job and a load job of a
realistic batch (engine block ids a random subset, out of order; slots as a
fresh manager hands them out, or scattered with `--pattern scattered`). The
best of the repeats is compared, all measured side by side in one run. Then
every byte is verified: the slots hold the blocks' real bytes, nothing else in
the pool changed, the loaded blocks hold them again and nothing else in the
engine changed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kv_offload.canonical import CanonicalKVCaches, canonicalize
from kv_offload.specs import FullAttentionSpec, KVCacheGroup
from kv_offload.testing.engine_alloc import LAYOUTS, allocate_kv_caches
from kv_offload.testing.example_models import EXAMPLE_MODELS, build_example

POOL_FILL, ENGINE_FILL = 0x33, 0x5A  # what untouched bytes must still hold
# Pause before each timed phase: after torch's parallel copy its OpenMP threads keep
# spinning on the cores for milliseconds, which would slow whatever runs next.
SETTLE_S = 0.05


@dataclass(frozen=True)
class Model:
    name: str
    kv_caches: dict
    groups: list[KVCacheGroup]
    num_blocks: int
    buffer: torch.Tensor


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["cpu", "filesystem", "valkey", "s3"],
                        default="cpu")
    parser.add_argument("--model", choices=sorted(EXAMPLE_MODELS), default="llama-8b")
    parser.add_argument("--page-kib", type=int, default=None, metavar="N",
                        help="synthetic single-group model with N KiB pages (overrides --model)")
    parser.add_argument("--layers", type=int, default=1,
                        help="layers of the synthetic --page-kib model (default 1)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="LBNHC")
    parser.add_argument("--batch-mib", type=int, default=256,
                        help="bytes moved per job, in MiB (default 256)")
    parser.add_argument("--pattern", choices=["fresh", "scattered"], default="fresh",
                        help="slot ids: consecutive as a fresh manager hands them out, or a "
                             "random subset (both sides scattered)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--fs-root", default="/tmp/kv-offload-bench",
                        help="--backend filesystem: a directory on the disk to measure "
                             "(not tmpfs); chunks are --page-kib KiB (default 2048)")
    parser.add_argument("--chunks", type=int, default=256,
                        help="--backend filesystem: number of chunks written and read")
    shared = parser.add_argument_group("--backend valkey|s3 (the filesystem tier runs the "
                                       "same cells in --fs-root)")
    shared.add_argument("--url", help="valkey: redis://HOST:PORT/DB (default: start a "
                                      "loopback server)")
    shared.add_argument("--endpoint-url", help="s3: the endpoint (default: moto on loopback)")
    shared.add_argument("--bucket", help="s3: an existing bucket (with --endpoint-url)")
    shared.add_argument("--value-mib", type=float, nargs="+", default=[1, 4, 16])
    shared.add_argument("--connections", type=int, nargs="+", default=[1, 4, 8])
    shared.add_argument("--total-mib", type=int, default=256,
                        help="bytes written and read per cell (default 256)")


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark, print a table, write JSON; exit status 1 on any mismatch."""
    result = BACKENDS[args.backend](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["mismatches"] == 0 else 1


def synthetic_model(page_kib: int, layers: int, num_blocks: int, layout: str) -> Model:
    """One full-attention group of `layers` layers whose pages are `page_kib` KiB
    (16 bf16 tokens; 128-wide heads when the size allows, else one narrower head)."""
    if page_kib <= 0 or layers <= 0:
        raise ValueError(f"--page-kib and --layers must be positive, got {page_kib}, {layers}")
    heads, head = (page_kib // 8, 128) if page_kib % 8 == 0 else (1, 16 * page_kib)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head,
                             dtype=torch.bfloat16)
    groups = [KVCacheGroup([f"layer.{i}" for i in range(layers)], spec)]
    buffer, caches = allocate_kv_caches(groups, num_blocks, layout)
    return Model(f"synthetic-{page_kib}KiB-x{layers}", caches, groups, num_blocks, buffer)


def build_model(args: argparse.Namespace) -> tuple[Model, CanonicalKVCaches, int]:
    """The model, its canonical view, and blocks per group for a batch of --batch-mib."""
    def sized(make: Callable[[int], Model]) -> tuple[Model, CanonicalKVCaches, int]:
        probe = make(1)
        probe_view = canonicalize(probe.kv_caches, probe.groups, 1)
        per_block = sum(probe_view.data_bytes_per_block(g) for g in range(len(probe.groups)))
        per_group = max(4, (args.batch_mib << 20) // per_block)
        model = make(2 * per_group * len(probe.groups))  # room for gaps and other targets
        return model, canonicalize(model.kv_caches, model.groups, model.num_blocks), per_group

    if args.page_kib is not None:
        return sized(lambda n: synthetic_model(args.page_kib, args.layers, n, args.layout))
    return sized(lambda n: example_model(args.model, n, args.layout))


def example_model(name: str, num_blocks: int, layout: str) -> Model:
    m = build_example(name, num_blocks, layout=layout)
    return Model(m.name, m.kv_caches, m.groups, m.num_blocks, m.buffer)


def fill_pattern(buffer: torch.Tensor) -> None:
    """Every 8-byte word distinct: a misplaced page cannot go unnoticed."""
    words = buffer.view(torch.int64)
    torch.arange(words.numel(), out=words).mul_(0x9E3779B97F4A7C15 - (1 << 64))


def bench_cpu(args: argparse.Namespace) -> dict:
    from kv_offload.backends.cpu import CpuBackend

    rng = np.random.default_rng(args.seed)
    model, canonical, per_group = build_model(args)
    groups = range(len(model.groups))
    slots_needed = per_group * len(model.groups)
    num_slots = slots_needed * (2 if args.pattern == "scattered" else 1)
    slot_bytes = max(canonical.slot_bytes_per_block(g) for g in groups)
    backend = CpuBackend(canonical, num_slots * slot_bytes)
    try:
        fill_pattern(model.buffer)
        backend.pool.fill_(POOL_FILL)  # touch every page before timing anything
        blocks = rng.permutation(model.num_blocks)  # a block belongs to one group at a time
        targets = rng.permutation(model.num_blocks)
        slots = (np.arange(slots_needed) if args.pattern == "fresh"
                 else rng.permutation(num_slots)[:slots_needed])
        stores = {g: (blocks[g::len(groups)][:per_group], slots[g::len(groups)])
                  for g in groups}
        loads = {g: (targets[g::len(groups)][:per_group], slots[g::len(groups)]) for g in groups}
        plan = backend.copier.plan(_direction("store"), stores)
        total = plan.num_bytes
        src = model.buffer.view(-1)[:total]
        dst = backend.pool.view(-1)[:total]
        times: dict[str, list[float]] = {"baseline": [], "store": [], "load": []}
        for rep in range(args.repeats):
            _progress(rep, args.repeats, model.name)
            time.sleep(SETTLE_S)
            start = time.perf_counter()
            dst.copy_(src)
            times["baseline"].append(time.perf_counter() - start)
            time.sleep(SETTLE_S)
            times["store"].append(_run_job(backend, backend.submit_store, stores))
            time.sleep(SETTLE_S)
            times["load"].append(_run_job(backend, backend.submit_load, loads))
        print(file=sys.stderr)
        fill_pattern(model.buffer)
        mismatches = _verify(backend, canonical, model, stores, loads)
        strategies = {d: list(backend.copier.last_strategies(_direction(d)))
                      for d in ("store", "load")}
    finally:
        backend.close()
    best = {k: total / min(v) / 1e9 for k, v in times.items()}
    median = {k: total / statistics.median(v) / 1e9 for k, v in times.items()}
    refs = canonical.group_refs[0]
    return {
        "backend": "cpu", "model": model.name, "layout": args.layout, "pattern": args.pattern,
        "store_gbps": best["store"], "load_gbps": best["load"],
        "baseline_gbps": best["baseline"],
        "store_ratio": best["store"] / best["baseline"],
        "load_ratio": best["load"] / best["baseline"],
        "median_gbps": median, "mismatches": mismatches,
        "page_bytes": refs[0].page_size_bytes, "layers_per_group": len(refs),
        "groups": len(model.groups), "blocks": per_group * len(model.groups),
        "bytes_per_job": total, "repeats": args.repeats, "strategies": strategies,
        "torch_threads": torch.get_num_threads(),
    }


def _direction(name: str):
    from kv_offload.transfer import Direction

    return Direction(name)


def _run_job(backend, submit, transfers) -> float:
    """Submit one job, wait for it; its wall time (queueing included)."""
    start = time.perf_counter()
    (result,) = backend.wait([submit(transfers)])
    elapsed = time.perf_counter() - start
    if not result.success:
        raise RuntimeError(f"benchmark job failed: {result.error}")
    return elapsed


def _progress(rep: int, repeats: int, name: str) -> None:
    done = int(20 * rep / repeats)
    print(f"\r[{'#' * done}{'.' * (20 - done)}] {name}: repeat {rep + 1}/{repeats}",
          end="", file=sys.stderr, flush=True)


def _slot_offsets(canonical: CanonicalKVCaches, group: int) -> list[int]:
    return np.cumsum([0] + [r.slot_bytes for r in canonical.group_refs[group]])[:-1].tolist()


def _verify(backend, canonical: CanonicalKVCaches, model: Model, stores, loads) -> int:
    """Wrong bytes after one more store and load, checked through the canonical
    refs directly (not through the copier's fused views)."""
    pool = backend.pool
    pool.fill_(POOL_FILL)
    _run_job(backend, backend.submit_store, stores)
    bad = 0
    for g, (blocks, slots) in stores.items():
        b, s = torch.from_numpy(np.asarray(blocks)), torch.from_numpy(backend.pool_rows(slots))
        for ref, off in zip(canonical.group_refs[g], _slot_offsets(canonical, g)):
            engine = canonical.tensors[ref.tensor_idx].tensor
            page = slice(ref.offset_bytes, ref.offset_bytes + ref.page_size_bytes)
            host = slice(off, off + ref.page_size_bytes)
            bad += int((pool[s, host] != engine[b, page]).sum())
            pool[s, host] = POOL_FILL
    bad += int((pool != POOL_FILL).sum())  # padding and unused slots untouched
    _run_job(backend, backend.submit_store, stores)
    model.buffer.fill_(ENGINE_FILL)
    _run_job(backend, backend.submit_load, loads)
    for g, (blocks, slots) in loads.items():
        b, s = torch.from_numpy(np.asarray(blocks)), torch.from_numpy(backend.pool_rows(slots))
        for ref, off in zip(canonical.group_refs[g], _slot_offsets(canonical, g)):
            engine = canonical.tensors[ref.tensor_idx].tensor
            page = slice(ref.offset_bytes, ref.offset_bytes + ref.page_size_bytes)
            bad += int((engine[b, page] != pool[s, off:off + ref.page_size_bytes]).sum())
            engine[b, page] = ENGINE_FILL
    return bad + int((model.buffer != ENGINE_FILL).sum())  # nothing else written


def format_table(r: dict) -> str:
    lines = [
        f"kv-offload bench: backend={r['backend']} model={r['model']} layout={r['layout']} "
        f"pattern={r['pattern']}",
        f"  {r['blocks']} blocks in {r['groups']} group(s), {r['layers_per_group']} layers x "
        f"{r['page_bytes']} B pages, {r['bytes_per_job'] / 2**20:.1f} MiB per job, best of "
        f"{r['repeats']}",
        f"  {'':10}{'GB/s':>8}{'ratio':>8}  strategy",
        f"  {'baseline':10}{r['baseline_gbps']:8.2f}{1.0:8.2f}  one torch copy",
        f"  {'store':10}{r['store_gbps']:8.2f}{r['store_ratio']:8.2f}  "
        f"{','.join(r['strategies']['store'])}",
        f"  {'load':10}{r['load_gbps']:8.2f}{r['load_ratio']:8.2f}  "
        f"{','.join(r['strategies']['load'])}",
        f"  mismatches: {r['mismatches']}",
    ]
    return "\n".join(lines)


def _cpu(args: argparse.Namespace) -> dict:
    result = bench_cpu(args)
    print(format_table(result))
    return result


def _filesystem(args: argparse.Namespace) -> dict:
    """The filesystem tier against raw O_DIRECT I/O of the same bytes (prints its table)."""
    from kv_offload.tools.bench_filesystem import run_filesystem_bench

    return run_filesystem_bench(args.fs_root, (args.page_kib or 2048) * 1024, args.chunks)


def _shared_store(args: argparse.Namespace) -> dict:
    """A shared-store tier against the filesystem tier, same cells (prints its table)."""
    from kv_offload.tools.bench_tiers import run_shared_store_bench

    return run_shared_store_bench(args)


# Each backend runs, prints its table and returns the JSON result.
BACKENDS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "cpu": _cpu, "filesystem": _filesystem, "valkey": _shared_store, "s3": _shared_store}
