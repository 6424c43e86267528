"""The GPU copy paths side by side, against the PCIe limit measured in the same run.

For each model (llama-8b as vLLM lays it out, and synthetic models with small pages),
each job size (blocks) and each slot pattern, a store (GPU -> pinned host) and a load
(pinned host -> GPU) job is timed through `BlockCopier.submit` with each path forced:
2D copies (`dma`), one batched memcpy (`batch`) and the copy kernel (`kernel`), and
with the rule's own choice (`auto`, `cuda_calls.choose_path`). Two figures per job:
the host time `submit` takes to enqueue it, and the wall time until its event completes
(enqueue included). The baseline is one plain copy of one large pinned buffer each way.

Patterns: `runs` (consecutive blocks into consecutive slots, as a long prompt of a fresh
engine: few long 2D copies) and `scattered` (random blocks into random slots: one copy
per block and page).

Every path's bytes are compared with the others' (pool after the store, engine after
the load): a path that moves different bytes is reported, never timed silently.

    python benchmarks/bench_cuda_paths.py --json bench-cuda-paths.json
    python benchmarks/bench_cuda_paths.py --host  # the same code on the tests' host executor

`--host` runs every step without a GPU (tests/helpers/host_cuda.py stands in for CUDA):
it checks the script, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path as FilePath

import numpy as np
import torch

from kv_offload import canonicalize
from kv_offload.kernels import BlockCopier, Direction, HostSlotLayout
from kv_offload.kernels.cuda import plan_calls
from kv_offload.kernels.cuda_calls import choose_path
from kv_offload.specs import FullAttentionSpec, KVCacheGroup
from kv_offload.testing.engine_alloc import allocate_kv_caches
from kv_offload.testing.example_models import build_example

PATHS = ("dma", "batch", "kernel", "auto")
MIB = 1 << 20


@dataclass
class Case:
    name: str
    groups: list
    layout: str


def synthetic(page_kib: int, layers: int) -> Case:
    heads, head = (page_kib // 8, 128) if page_kib % 8 == 0 else (1, 16 * page_kib)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head,
                             dtype=torch.bfloat16)
    return Case(f"{page_kib}KiB-pages-x{layers}",
                [KVCacheGroup([f"layer.{i}" for i in range(layers)], spec)], "LBNHC")


def llama(layout: str) -> Case:
    return Case(f"llama-8b-{layout}", build_example("llama-8b", 1, layout=layout,
                                                    device="meta").groups, layout)


class Rig:
    """Where engine memory and the pinned pool come from: the GPU, or the host
    executor of the tests (`--host`)."""

    def __init__(self, host: bool) -> None:
        self.host = host
        if host:
            sys.path.insert(0, str(FilePath(__file__).resolve().parent.parent / "tests"))
            from helpers.host_cuda import HostCudaRuntime

            self.runtime = HostCudaRuntime()
            self.device = "cpu"
        else:
            self.runtime = None  # BlockCopier picks the cupy runtime for GPU tensors
            self.device = "cuda"

    def engine(self, case: Case, num_blocks: int):
        buffer, caches = allocate_kv_caches(case.groups, num_blocks, case.layout,
                                            device=self.device)
        if self.host:
            self.runtime.register(buffer)
        return buffer, canonicalize(caches, case.groups, num_blocks)

    def pool(self, num_slots: int, slot_bytes: int) -> torch.Tensor:
        if self.host:
            raw = self.runtime.pinned_empty(num_slots * slot_bytes)
            return raw.view(torch.int8).view(num_slots, slot_bytes)
        return torch.empty(num_slots, slot_bytes, dtype=torch.int8, pin_memory=True)

    def sync(self) -> None:
        if not self.host:
            torch.cuda.synchronize()

    def name(self) -> str:
        return "host executor (no GPU: numbers mean nothing)" if self.host else \
            torch.cuda.get_device_name()


def pcie_baseline(rig: Rig, nbytes: int, repeats: int) -> dict:
    """One plain copy of one pinned buffer to the GPU and back: the link's limit."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=not rig.host)
    device = torch.empty(nbytes, dtype=torch.uint8, device=rig.device)
    host.fill_(1)
    out = {}
    for name, dst, src in (("d2h", host, device), ("h2d", device, host)):
        times = []
        for _ in range(repeats + 1):
            rig.sync()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            rig.sync()
            times.append(time.perf_counter() - start)
        out[f"{name}_gbps"] = nbytes / statistics.median(times[1:]) / 1e9
    return out


def jobs(pattern: str, blocks: int, num_blocks: int, num_slots: int, rng):
    """Store and load transfers of one group: `runs` or `scattered`."""
    if pattern == "runs":
        store = (np.arange(blocks), np.arange(blocks))
        load = (np.arange(blocks) + blocks, np.arange(blocks))
    else:
        store = (rng.permutation(num_blocks)[:blocks], rng.permutation(num_slots)[:blocks])
        load = (rng.permutation(num_blocks)[:blocks], store[1])
    return {0: store}, {0: load}


def timed(rig: Rig, copier: BlockCopier, plan, path: str | None, repeats: int):
    """Median host enqueue time and median wall time (enqueue to completion), seconds."""
    enqueue, wall = [], []
    for i in range(repeats + 1):  # the first is a warm-up (kernel build, descriptor pools)
        rig.sync()
        start = time.perf_counter()
        job = copier.submit(plan, None, path)
        queued = time.perf_counter()
        job.wait()
        done = time.perf_counter()
        if job.error is not None:
            raise job.error
        if i:
            enqueue.append(queued - start)
            wall.append(done - start)
    return statistics.median(enqueue), statistics.median(wall)


def measure(rig: Rig, case: Case, blocks: int, pattern: str, repeats: int, rng,
            paths=PATHS) -> list[dict]:
    num_blocks, num_slots = 2 * blocks, 2 * blocks
    buffer, canonical = rig.engine(case, num_blocks)
    layout = HostSlotLayout.from_canonical(canonical)
    pool = rig.pool(num_slots, layout.slot_bytes)
    copier = BlockCopier(canonical, pool, layout, runtime=rig.runtime)
    stores, loads = jobs(pattern, blocks, num_blocks, num_slots, rng)
    plans = {"store": copier.plan(Direction.STORE, stores),
             "load": copier.plan(Direction.LOAD, loads)}
    buffer.view(torch.int64).copy_(torch.arange(buffer.numel() // 8, device=buffer.device))
    rows, reference = [], {}
    for path in paths:
        forced = None if path == "auto" else path
        if path == "batch" and not copier.runtime.batch_available:
            continue
        for direction, plan in plans.items():
            pool.fill_(0x33)
            if direction == "load":
                copier.copy(plans["store"], forced)
                buffer_before = buffer.clone()
                buffer.fill_(0x5A)
            enqueue_s, wall_s = timed(rig, copier, plan, forced, repeats)
            result = (pool if direction == "store" else buffer).clone()
            first = reference.setdefault(direction, result)
            same = bool(torch.equal(first, result))
            if direction == "load":
                buffer.copy_(buffer_before)
            rows.append(dict(
                case=case.name, blocks=blocks, pattern=pattern, direction=direction, path=path,
                chosen=",".join(copier.last_strategies(Direction(direction))),
                bytes=plan.num_bytes, enqueue_us=enqueue_s * 1e6, wall_us=wall_s * 1e6,
                gbps=plan.num_bytes / wall_s / 1e9, same_bytes_as_first_path=same,
                pieces=pieces(copier, plan)))
    return rows


def pieces(copier: BlockCopier, plan) -> dict:
    """2D calls and 1-D copies the plan makes, and what the rule picks for them."""
    calls = copies = 0
    chosen = set()
    runtime = copier.runtime
    for c in plan_calls(copier.segments, plan):
        calls, copies = calls + c.count, copies + c.copy_count
        chosen.add(choose_path(c, batch_available=runtime.batch_available,
                               max_pitch=runtime.max_pitch).value)
    return {"calls_2d": calls, "copies_1d": copies, "rule": sorted(chosen)}


def summary(rows: list[dict]) -> list[dict]:
    """Per job: the fastest path, and how far the rule's choice is from it."""
    out = []
    keys = sorted({(r["case"], r["blocks"], r["pattern"], r["direction"]) for r in rows})
    for key in keys:
        cell = {r["path"]: r for r in rows
                if (r["case"], r["blocks"], r["pattern"], r["direction"]) == key}
        forced = {p: r for p, r in cell.items() if p != "auto"} or cell
        best = min(forced, key=lambda p: forced[p]["wall_us"])
        auto = cell.get("auto")
        out.append(dict(case=key[0], blocks=key[1], pattern=key[2], direction=key[3],
                        best=best, best_gbps=forced[best]["gbps"],
                        auto=auto["chosen"] if auto else None,
                        auto_over_best=(auto["wall_us"] / forced[best]["wall_us"])
                        if auto else None, mib=forced[best]["bytes"] / MIB,
                        **{f"{p}_us": r["wall_us"] for p, r in cell.items()},
                        **{f"{p}_enqueue_us": r["enqueue_us"] for p, r in cell.items()}))
    return out


def print_table(rig: Rig, baseline: dict, rows: list[dict], cells: list[dict]) -> None:
    print(f"device: {rig.name()}")
    print(f"PCIe baseline (one pinned buffer): d2h {baseline['d2h_gbps']:.1f} GB/s, "
          f"h2d {baseline['h2d_gbps']:.1f} GB/s")
    head = (f"{'case':<22}{'blocks':>7} {'pattern':<10}{'dir':<6}{'MiB':>8}"
            + "".join(f"{p + ' us':>11}" for p in PATHS) + f"{'best':>8}{'GB/s':>7}"
            f"{'auto':>8}{'auto/best':>10}")
    print(head)
    for c in cells:
        times = "".join(f"{c.get(p + '_us', float('nan')):>11.0f}" for p in PATHS)
        ratio = c["auto_over_best"] if c["auto_over_best"] is not None else float("nan")
        print(f"{c['case']:<22}{c['blocks']:>7} {c['pattern']:<10}{c['direction']:<6}"
              f"{c['mib']:>8.1f}{times}{c['best']:>8}{c['best_gbps']:>7.1f}"
              f"{c['auto'] or '-':>8}{ratio:>10.2f}")
    bad = [r for r in rows if not r["same_bytes_as_first_path"]]
    print(f"paths that moved other bytes than the first path: {len(bad)}")
    for r in bad:
        print("  MISMATCH", r["case"], r["blocks"], r["pattern"], r["direction"], r["path"])


def experiment(args: argparse.Namespace) -> None:
    """Set the kernel's knobs for this process (what the flags measure)."""
    from kv_offload.kernels import cuda, cuda_calls

    if args.kernel_chunk_kib is not None:
        cuda_calls.KERNEL_CHUNK_BYTES = cuda_calls.KERNEL_MIN_CHUNK_BYTES = \
            args.kernel_chunk_kib << 10
    if args.kernel_grid is not None:
        grid = args.kernel_grid
        cuda.kernel_grid = lambda pieces, multiprocessors: max(1, min(pieces, grid))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", action="store_true",
                        help="run on the tests' host executor (no GPU; checks the script)")
    parser.add_argument("--page-kib", type=int, nargs="+", default=[2, 16],
                        help="synthetic models' page sizes (default 2 16)")
    parser.add_argument("--layers", type=int, default=32, help="synthetic models' layers")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 64, 512, 2048])
    parser.add_argument("--patterns", nargs="+", default=["runs", "scattered"])
    parser.add_argument("--max-job-mib", type=float, default=512,
                        help="skip jobs larger than this")
    parser.add_argument("--baseline-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--kernel-chunk-kib", type=int, default=None,
                        help="experiment: cut kernel copies to this fixed size (default: "
                             "cuda_calls.kernel_chunk_bytes)")
    parser.add_argument("--kernel-grid", type=int, default=None,
                        help="experiment: at most this many thread blocks per launch "
                             "(default: cuda.kernel_grid, one per SM)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    experiment(args)
    rig = Rig(args.host)
    rng = np.random.default_rng(0)
    baseline = pcie_baseline(rig, args.baseline_mib * MIB, args.repeats)
    cases = [llama("LBNHC")] + [synthetic(k, args.layers) for k in args.page_kib]
    rows = []
    for case in cases:
        per_block = sum(case.groups[0].spec.page_size_bytes for _ in case.groups[0].layer_names)
        for blocks in args.blocks:
            if blocks * per_block > args.max_job_mib * MIB:
                continue
            for pattern in args.patterns:
                rows += measure(rig, case, blocks, pattern, args.repeats, rng, args.paths)
                print(f"  {case.name} {blocks} {pattern} done", file=sys.stderr, flush=True)
    cells = summary(rows)
    print_table(rig, baseline, rows, cells)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": rig.name(), "torch": torch.__version__,
                       "kernel_chunk_kib": args.kernel_chunk_kib,
                       "kernel_grid": args.kernel_grid,
                       "baseline": baseline, "repeats": args.repeats,
                       "statistic": "median of repeats (after one warm-up)",
                       "cells": cells, "rows": rows}, f, indent=1)
    return 1 if any(not r["same_bytes_as_first_path"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
