"""What TP-free records cost a rank at its own TP size: stores and loads through the disk tier.

One rank of the Llama-3-8B example model (8 KV heads, 32 layers, 16-token blocks; at TP=1 a
block is 2 MiB, at TP=2 a rank's share is 1 MiB) in a `TieredStore` over a filesystem tier,
opened as before this change (`records=None`: the rank's pages under its own fingerprint)
and as the connector opens it now (`rank_records`: one record per block with the rank's
heads, under the shared fingerprint). Per run and variant, in turns:
- store: `--blocks` blocks copied out of the engine and written through to disk (until the
  last file landed);
- load: a fresh store over that directory (empty host tier) loads them back (read from
  disk into host slots, then into the engine).
Both for the engine's page layouts: LBHNC (the CPU build: a record is the host slot itself,
no copy) and LBNHC (the GPU default: a record is packed on write and unpacked on read, by
the filesystem tier's I/O threads). Each store's host pool is touched before the clock
starts, as a serving process's pool is (pinned on a GPU host: locked at start-up; else
touched by its first stores): a fresh pool's first touch (the kernel zeroing each page on
its first write) is not the cost of a store or load. `--cold-host-pool` keeps it in (as
this benchmark measured before: it then charges those faults to whichever thread writes
the slot first: the I/O read itself before, the unpack now).
A third variant, `cross`, loads at TP=1 what two TP=2 ranks stored (and at TP=2 what TP=1
stored: a rank reads the TP=1 record, 2x its bytes, and takes its half).

    python benchmarks/bench_tp_records.py --runs 5 --json tp-records.json

Prints GB/s medians per cell and the now/before ratio (goal: >= 0.9), per wall second and
per CPU second of the process (all its threads: what the layer adds is CPU work; the CPU
ratio is the one a loaded machine does not drown).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from kv_offload.canonical import canonicalize
from kv_offload.config import parse_config
from kv_offload.store.tiered import TieredStore, layout_fingerprint
from kv_offload.store.tp.records import TPShare, rank_records
from kv_offload.testing.example_models import build_example
from kv_offload.types import Location

MODEL, HEADS = "llama-8b", 8


def open_rank(root: str, tp: int, rank: int, layout: str, blocks: int, shared: bool,
              warm: bool):
    model = build_example(MODEL, blocks, layout=layout, tp_size=tp)
    torch.manual_seed(rank)
    model.buffer.copy_(torch.randint(-128, 128, model.buffer.shape, dtype=torch.int8))
    canonical = canonicalize(model.kv_caches, model.groups, blocks)
    shape_fp = layout_fingerprint(canonical, f"bench|tp{tp}|rank{rank}")
    records = rank_records(canonical, model.kv_caches, model.groups,
                           TPShare("bench", tp, rank, HEADS), shape_fp) if shared else None
    slot = canonical.slot_bytes_per_block(0)
    config = parse_config({"cpu_bytes_to_use": (blocks + 1) * slot, "storage_tier": "filesystem",
                           "storage_options": {"root_dir": root, "bytes_to_use": "8GiB"}})
    store = TieredStore.from_config(canonical, config, shape_fp, records=records)
    if warm:  # (every page of the host pool written once, as in a running server)
        store.cpu.pool.fill_(0)
    return store, slot


def hashes(blocks: int) -> list[bytes]:
    return [i.to_bytes(8, "little") for i in range(blocks)]


def store(root, tp, layout, blocks, shared, ranks, warm) -> tuple[float, float]:
    """Wall and CPU seconds (all threads of this process) until every rank's blocks are on
    disk (ranks in turn, as one process)."""
    wall = cpu = 0.0
    for rank in ranks:
        s, _ = open_rank(root, tp, rank, layout, blocks, shared, warm)
        t0, c0 = time.perf_counter(), time.process_time()
        [res] = s.wait([s.submit_store({0: (hashes(blocks), list(range(blocks)))})])
        assert res.success and s.flush()
        wall, cpu = wall + time.perf_counter() - t0, cpu + time.process_time() - c0
        s.close()
    return wall, cpu


def load(root, tp, rank, layout, blocks, shared, warm) -> tuple[float, float]:
    s, _ = open_rank(root, tp, rank, layout, blocks, shared, warm)
    keys = [(h, 0) for h in hashes(blocks)]
    deadline = time.monotonic() + 30
    while s.lookup(keys) != [Location.STORAGE] * blocks:
        assert time.monotonic() < deadline, "the stored blocks never showed"
        s.poll()
        time.sleep(0.001)
    t0, c0 = time.perf_counter(), time.process_time()
    [res] = s.wait([s.submit_load({0: (hashes(blocks), list(range(blocks)))})])
    seconds = time.perf_counter() - t0, time.process_time() - c0
    assert res.success and res.from_storage == blocks
    s.close()
    return seconds


def one_run(tp: int, layout: str, blocks: int, variant: str, warm: bool) -> dict[str, float]:
    """GB/s of one rank's bytes per wall second and per CPU second: store and load (rank 0
    of `tp`)."""
    shared = variant != "before"
    with tempfile.TemporaryDirectory(dir=".") as root:
        model = build_example(MODEL, 1, layout=layout, tp_size=tp)
        nbytes = blocks * canonicalize(model.kv_caches, model.groups, 1).slot_bytes_per_block(0)
        if variant == "cross":  # written by the other TP size, read by rank 0 of `tp`
            other = 2 if tp == 1 else 1
            store(root, other, layout, blocks, True, range(other), warm)
            stored = (float("nan"), float("nan"))
        else:
            stored = store(root, tp, layout, blocks, shared, [0], warm)
        loaded = load(root, tp, 0, layout, blocks, shared, warm)
        return {"store": nbytes / stored[0] / 1e9, "store_cpu": nbytes / stored[1] / 1e9,
                "load": nbytes / loaded[0] / 1e9, "load_cpu": nbytes / loaded[1] / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--json", default=None)
    parser.add_argument("--cold-host-pool", action="store_true",
                        help="do not touch the host pool before timing (see the docstring)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cells: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.runs):  # variants in turns: every run sees the same outside load
        for tp in (1, 2):
            for layout in ("LBHNC", "LBNHC"):
                for variant in ("before", "now", "cross"):
                    got = one_run(tp, layout, args.blocks, variant, not args.cold_host_pool)
                    cell = cells.setdefault(f"TP={tp} {layout} {variant}", {})
                    for op, value in got.items():
                        cell.setdefault(op, []).append(value)
    medians = {name: {op: statistics.median(v) for op, v in ops.items()}
               for name, ops in cells.items()}
    for unit, suffix in (("wall", ""), ("CPU", "_cpu")):
        pool = "cold" if args.cold_host_pool else "touched"
        print(f"GB/s of one rank's bytes per {unit} second, median of {args.runs} runs, "
              f"{args.blocks} blocks, host pool {pool}")
        print("| shape | store before | store now | ratio | load before | load now | ratio | "
              "load of the other TP size's records |")
        print("|---|---|---|---|---|---|---|---|")
        for tp in (1, 2):
            for layout in ("LBHNC", "LBNHC"):
                b, n = medians[f"TP={tp} {layout} before"], medians[f"TP={tp} {layout} now"]
                c = medians[f"TP={tp} {layout} cross"]
                st, ld = "store" + suffix, "load" + suffix
                print(f"| TP={tp} {layout} | {b[st]:.2f} | {n[st]:.2f} | {n[st] / b[st]:.2f} | "
                      f"{b[ld]:.2f} | {n[ld]:.2f} | {n[ld] / b[ld]:.2f} | {c[ld]:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": cells, "medians": medians}, f, indent=1)


if __name__ == "__main__":
    main()
