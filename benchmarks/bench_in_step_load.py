"""What an in-step hit adds to `start_load_kv`, against a plain copy of the same bytes.

Issue 23 asks a host-tier hit to cost at most 1.05x of vLLM's own in-memory prefix hit, and
a disk hit 1.5x. In `bench_ttft.py` the difference is our `start_load_kv` (an in-step load
of 16 MiB: 62 blocks of 256 KiB, 8 layers); that benchmark's spread between engine
processes hides a millisecond. This one times the connector's worker alone, in one process,
on the same shape as bench_ttft's Llama-like model (per-layer caches, block size 32):

  plain        one torch `copy_` per layer from a host tensor into the hit's blocks (they
               are consecutive, as in a fresh engine), on the calling thread with torch's
               own intra-op threads: the floor any load pays, when those threads are awake
  plain_1t     the same copies on one thread of a pool (single-threaded torch)
  backend      `HostTier.submit_load` + `wait` of the 62 blocks (our copier, planning
               included, no worker around it)
  worker       `OffloadWorker.start_loads(..., in_step=...)`: what `start_load_kv` runs
               for an in-step host hit (lookup in the store, the job, the copy, the wait)
  worker_disk  the same for a hit on disk only (a second worker over a filesystem tier in a
               temporary directory: O_DIRECT reads of 62 files into host slots, then the
               copy), as a new engine process's in-step disk hit

The ways alternate within each round (the order rotating), after a warm-up; the table has
the median over rounds (p10 and p90 beside it) and the ratio of each median to `plain_1t`'s
(torch's own threads, asleep after the pause each round begins with, spread the most).

    python benchmarks/bench_in_step_load.py --json in-step-load.json
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kv_offload.canonical import canonicalize
from kv_offload.config import OffloadConfig
from kv_offload.kernels.cpu import serial_torch_thread
from kv_offload.specs import FullAttentionSpec, KVCacheGroup
from kv_offload.store.host import HostTier
from kv_offload.testing.engine_alloc import allocate_kv_caches
from kv_offload.vllm.worker.offload_worker import OffloadWorker

LAYERS, BLOCK_SIZE, HEADS, HEAD_SIZE = 8, 32, 4, 64  # bench_ttft's Llama-like model


def block_hash(i: int, salt: bytes) -> bytes:
    return hashlib.sha256(salt + i.to_bytes(4, "little")).digest()


SETS = 5  # hits of the disk way: the host tier holds 4, so each load finds its set on disk


def disk_worker(caches, groups, engine_blocks: int, blocks: int, block_bytes: int,
                root: str) -> tuple[OffloadWorker, list[list[bytes]]]:
    """A worker over a disk tier whose host tier holds SETS - 1 hits: every hit stored and
    written through, the first one evicted from host memory (on disk only)."""
    config = OffloadConfig(cpu_bytes_to_use=(SETS - 1) * blocks * block_bytes,
                           storage_tier="filesystem",
                           storage_options={"root_dir": root,
                                            "bytes_to_use": 4 * SETS * blocks * block_bytes})
    worker = OffloadWorker(config, 0, "bench-in-step-disk")
    worker.register(caches, groups, engine_blocks)
    sets = [[block_hash(i, b"disk-%d" % k) for i in range(blocks)] for k in range(SETS)]
    for k, hashes in enumerate(sets):
        worker.start_stores({0: (hashes, list(range(1 + k * blocks, 1 + (k + 1) * blocks)))})
        worker.wait_for_engine_copies(timeout_s=30)
        assert worker.store.flush(60.0), "the write-through to disk did not finish"
    return worker, sets


def one_run(blocks: int, rounds: int, engine_blocks: int) -> dict[str, list[float]]:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                             dtype=torch.bfloat16)
    groups = [KVCacheGroup([f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)], spec)]
    _, caches = allocate_kv_caches(groups, engine_blocks, "LBHNC")
    for cache in caches.values():
        cache.view(torch.int8).random_(-128, 127)
    block_bytes = LAYERS * spec.page_size_bytes
    worker = OffloadWorker(OffloadConfig(cpu_bytes_to_use=4 * blocks * block_bytes), 0,
                           "bench-in-step")
    worker.register(caches, groups, engine_blocks)
    host = {name: torch.empty((blocks, *cache.shape[1:]), dtype=cache.dtype)
            for name, cache in caches.items()}  # (blocks on dim 0)
    times: dict[str, list[float]] = {"plain": [], "plain_1t": [], "backend": [], "worker": [],
                                     "worker_disk": []}
    backend = disk = None
    root = tempfile.TemporaryDirectory()
    one_thread = ThreadPoolExecutor(1, initializer=serial_torch_thread)
    try:
        source = list(range(1, blocks + 1))
        hashes = [block_hash(i, b"bench") for i in range(blocks)]
        worker.start_stores({0: (hashes, source)})
        worker.wait_for_engine_copies(timeout_s=30)
        # A host tier of its own (the worker's store polls its backend): the same copier.
        backend = HostTier(canonicalize(caches, groups, engine_blocks), blocks * block_bytes)
        slot_ids = list(range(blocks))
        (stored,) = backend.wait([backend.submit_store({0: (source, slot_ids)})])
        assert stored.success

        def plain(dst: list[int]) -> None:  # (the blocks are consecutive: one slice each)
            for name, cache in caches.items():
                cache[dst[0]:dst[-1] + 1].copy_(host[name])

        def plain_1t(dst: list[int]) -> None:
            one_thread.submit(plain, dst).result()

        def worker_load(dst: list[int]) -> None:
            worker.start_loads({"r": {0: (hashes, dst)}}, in_step=["r"])
            assert not worker.take_block_errors()

        disk, sets = disk_worker(caches, groups, engine_blocks, blocks, block_bytes, root.name)
        disk_loads = itertools.count()

        def disk_load(dst: list[int]) -> None:
            hashes = sets[next(disk_loads) % SETS]  # (the least recently used: on disk only)
            disk.start_loads({"r": {0: (hashes, dst)}}, in_step=["r"])
            assert not disk.take_block_errors()

        def reads_so_far() -> int:
            return disk.store.storage.stats()["read_ok"]

        reads_before = reads_so_far()

        def backend_load(dst: list[int]) -> None:
            (result,) = backend.wait([backend.submit_load({0: (dst, slot_ids)})])
            assert result.success

        ways = {"plain": plain, "plain_1t": plain_1t, "backend": backend_load,
                "worker": worker_load, "worker_disk": disk_load}
        names = list(ways)
        for r in range(rounds + 2):  # two warm-up rounds
            for k in range(len(names)):
                name = names[(r + k) % len(names)]
                lo = 1 + (SETS + (r * len(names) + k) % 8) * blocks  # fresh blocks each time
                dst = list(range(lo, lo + blocks))
                time.sleep(0.02)
                start = time.perf_counter()
                ways[name](dst)
                took = time.perf_counter() - start
                if r >= 2:
                    times[name].append(took * 1e3)
        loads = next(disk_loads)
        assert reads_so_far() - reads_before == loads * blocks, "a disk-way load was not read " \
            f"from disk: {reads_so_far() - reads_before} reads for {loads} loads of {blocks}"
    finally:
        worker.shutdown()
        if disk is not None:
            disk.shutdown()
        root.cleanup()
        if backend is not None:
            backend.close()
        one_thread.shutdown()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=62, help="blocks of 256 KiB per hit")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    times = one_run(args.blocks, args.rounds, engine_blocks=(SETS + 8) * args.blocks + 1)
    mib = args.blocks * LAYERS * 2 * BLOCK_SIZE * HEADS * HEAD_SIZE * 2 / (1 << 20)
    plain = statistics.median(times["plain_1t"])
    print(f"in-step load of {args.blocks} blocks ({mib:.1f} MiB, {LAYERS} layers); "
          f"median of {args.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    print(f"{'':10s} {'ms p50':>8s} {'p10':>7s} {'p90':>7s} {'x 1t':>8s}")
    for name, values in times.items():
        q = statistics.quantiles(values, n=10)
        median = statistics.median(values)
        print(f"{name:10s} {median:8.2f} {q[0]:7.2f} {q[-1]:7.2f} {median / plain:8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"blocks": args.blocks, "rounds": args.rounds,
                                         "load_average": os.getloadavg(), "times_ms": times},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
