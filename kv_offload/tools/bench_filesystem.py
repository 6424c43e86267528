"""Filesystem tier throughput against the raw disk, measured side by side in one run.

Writes ``num_chunks`` chunks through ``FilesystemTier`` and reads them back into a second host
pool (bit-exact check), and in the same run moves the same bytes to and from one file with
sequential O_DIRECT I/O: the raw baseline. The baseline is the better of two request sizes
(the chunk size, and 64 MiB), so the ratio is not flattered by a weak baseline. Rounds alternate
baseline and tier; the medians are reported.

    python -m kv_offload.tools.bench_filesystem --root /tmp/kvbench --json out.json

``kv-offload bench --backend filesystem`` calls ``run_filesystem_bench``. Use a directory on a
real disk: tmpfs (/dev/shm) measures memory copies, not a disk.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig, aligned_host_buffer
from kv_offload.backends.filesystem.io_engine import host_view

MIB = 1 << 20
BIG_REQUEST = 64 * MIB


def _raw_write(path: str, pool: torch.Tensor, request: int, direct: bool) -> float:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    view = host_view(pool)
    start = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        for offset in range(0, len(view), request):
            os.pwritev(fd, [view[offset : offset + request]], offset)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _raw_read(path: str, pool: torch.Tensor, request: int, direct: bool) -> float:
    view = host_view(pool)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        for offset in range(0, len(view), request):
            os.preadv(fd, [view[offset : offset + request]], offset)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _direct_io_works(directory: str) -> bool:
    path = os.path.join(directory, "probe")
    page = mmap.mmap(-1, 4096)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            os.pwritev(fd, [page], 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _run_jobs(tier: FilesystemTier, submit, keys, views, per_job: int) -> tuple[float, int]:
    """Submit all chunks in jobs of ``per_job`` keys; wait for all; (seconds, failed keys)."""
    start = time.perf_counter()
    pending = {
        submit(keys[i : i + per_job], views[i : i + per_job])
        for i in range(0, len(keys), per_job)
    }
    failed = 0
    while pending:
        for result in tier.poll():
            pending.discard(result.job_id)
            failed += len(result.failed_keys)
        time.sleep(0.0002)
    return time.perf_counter() - start, failed


def run_filesystem_bench(
    root: str,
    chunk_bytes: int = 2 * MIB,
    num_chunks: int = 256,
    json_path: str | None = None,
    *,
    io_threads: int = 8,
    keys_per_job: int = 16,
    repeats: int = 3,
) -> dict:
    """Measure tier and raw-disk write/read throughput; print a table; optionally write JSON."""
    os.makedirs(root, exist_ok=True)
    work = tempfile.mkdtemp(prefix="kv-offload-bench-", dir=root)
    total = chunk_bytes * num_chunks
    source = aligned_host_buffer(total)
    noise = bytearray(np.random.default_rng(0).bytes(total))
    source.copy_(torch.frombuffer(noise, dtype=torch.uint8))
    del noise
    target = aligned_host_buffer(total)
    keys = [f"bench-chunk-{i}".encode() for i in range(num_chunks)]
    src_views = [source[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(num_chunks)]
    dst_views = [target[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(num_chunks)]
    raw_direct = _direct_io_works(work)
    raw_file = os.path.join(work, "raw.bin")
    samples: dict[str, list[float]] = {k: [] for k in ("tier_w", "tier_r", "raw_w", "raw_r")}
    mismatches = failed = 0
    direct_io = False
    try:
        for round_ in range(repeats):
            raw_w = min(_raw_write(raw_file, source, r, raw_direct)
                        for r in (chunk_bytes, BIG_REQUEST))
            tier_dir = os.path.join(work, f"tier-{round_}")
            tier = FilesystemTier(
                FilesystemTierConfig(tier_dir, "bench-layout", 4 * total, io_threads=io_threads,
                                     rescan_interval_s=0)
            )
            direct_io = tier.stats().direct_io
            tier_w, f_w = _run_jobs(tier, tier.submit_write, keys, src_views, keys_per_job)
            raw_r = min(_raw_read(raw_file, target, r, raw_direct)
                        for r in (chunk_bytes, BIG_REQUEST))
            target.fill_(0)
            tier_r, f_r = _run_jobs(tier, tier.submit_read, keys, dst_views, keys_per_job)
            failed += f_w + f_r
            mismatches += sum(not torch.equal(s, d) for s, d in zip(src_views, dst_views))
            tier.close()
            shutil.rmtree(tier_dir)
            for name, seconds in (("tier_w", tier_w), ("tier_r", tier_r), ("raw_w", raw_w),
                                  ("raw_r", raw_r)):
                samples[name].append(total / seconds / 1e9)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {name: statistics.median(values) for name, values in samples.items()}
    result = {
        "backend": "filesystem",
        "root": os.path.abspath(root),
        "chunk_bytes": chunk_bytes,
        "num_chunks": num_chunks,
        "io_threads": io_threads,
        "keys_per_job": keys_per_job,
        "repeats": repeats,
        "direct_io": direct_io,
        "baseline_direct_io": raw_direct,
        "baseline": "sequential pwritev/preadv of one file, best of chunk-size and 64 MiB requests",
        "write_gbps": med["tier_w"],
        "read_gbps": med["tier_r"],
        "baseline_write_gbps": med["raw_w"],
        "baseline_read_gbps": med["raw_r"],
        "write_ratio": med["tier_w"] / med["raw_w"],
        "read_ratio": med["tier_r"] / med["raw_r"],
        "mismatches": mismatches,
        "failed_keys": failed,
        "samples_gbps": samples,
    }
    _print_table(result)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _print_table(r: dict) -> None:
    print(
        f"filesystem tier vs raw disk: {r['num_chunks']} x {r['chunk_bytes'] / MIB:g} MiB, "
        f"io_threads={r['io_threads']}, O_DIRECT tier={r['direct_io']} "
        f"raw={r['baseline_direct_io']}, median of {r['repeats']}, root={r['root']}"
    )
    print(f"{'':8}{'tier GB/s':>12}{'raw GB/s':>12}{'ratio':>8}")
    for op in ("write", "read"):
        print(f"{op:8}{r[op + '_gbps']:12.2f}{r['baseline_' + op + '_gbps']:12.2f}"
              f"{r[op + '_ratio']:8.2f}")
    print(f"mismatches: {r['mismatches']}   failed keys: {r['failed_keys']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "kv-offload-bench"))
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--num-chunks", type=int, default=256)
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    run_filesystem_bench(
        args.root, int(args.chunk_mib * MIB), args.num_chunks, args.json_path,
        io_threads=args.io_threads, repeats=args.repeats,
    )


if __name__ == "__main__":
    main()
