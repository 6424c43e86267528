"""What a disk hit's reads cost: wall time and this process's CPU time per job of N values.

A disk hit of the bench_ttft model reads 62 files of 256 KiB. In the engine, the reader
threads share the GIL and two cores with the pump and the engine, so the Python a read costs
(user time) stretches the hit even where the device is the limit. This times jobs of
`--values` keys of `--value-kib` through a real `FilesystemTier` (O_DIRECT where the
filesystem allows it), the way the tiered store submits and polls them, and reports the
median wall time per job and the user and system CPU time per job (`getrusage`, averaged
over the jobs: it counts every thread of the process, the polling one included).

    python benchmarks/bench_fs_reads.py --json fs-reads.json
    PYTHONPATH=/path/to/older/tree python benchmarks/bench_fs_reads.py   # the same, older code
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path


def run(args: argparse.Namespace, root: str) -> dict:
    from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig
    from kv_offload.backends.filesystem.io_engine import aligned_host_buffer

    size = args.value_kib << 10
    tier = FilesystemTier(FilesystemTierConfig(
        root_dir=root, layout_fingerprint="bench-fs-reads", bytes_to_use=1 << 34,
        rescan_interval_s=0, io_threads=args.io_threads))
    keys = [f"key-{i}".encode() for i in range(args.values)]
    pool = aligned_host_buffer(args.values * size)
    buffers = [pool[i * size:(i + 1) * size] for i in range(args.values)]

    def job(submit) -> float:
        start = time.perf_counter()
        job_id = submit(keys, buffers)
        while True:  # (as the store polls: every 0.2 ms while it waits)
            results = [r for r in tier.poll() if r.job_id == job_id]
            if results:
                assert all(results[0].succeeded)
                return time.perf_counter() - start
            time.sleep(0.0002)

    try:
        pool.random_(0, 255)
        job(tier.submit_write)
        job(tier.submit_read)  # (the read path's first use)
        before = resource.getrusage(resource.RUSAGE_SELF)
        walls = [job(tier.submit_read) for _ in range(args.jobs)]
        after = resource.getrusage(resource.RUSAGE_SELF)
        direct = tier.stats().direct_io
    finally:
        tier.close()
    return {
        "wall_ms": statistics.median(walls) * 1e3,
        "user_ms": (after.ru_utime - before.ru_utime) * 1e3 / args.jobs,
        "system_ms": (after.ru_stime - before.ru_stime) * 1e3 / args.jobs,
        "direct_io": direct,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=62, help="keys per job (default 62)")
    parser.add_argument("--value-kib", type=int, default=256, help="KiB per key (default 256)")
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=40, help="timed jobs (default 40)")
    parser.add_argument("--root", help="directory for the files (default: a temporary one)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.root) as root:
        result = run(args, root)
    print(f"{args.values} reads of {args.value_kib} KiB, {args.io_threads} I/O threads, "
          f"O_DIRECT {'on' if result['direct_io'] else 'off'}; per job: wall (median of "
          f"{args.jobs}) {result['wall_ms']:.1f} ms, CPU user {result['user_ms']:.1f} ms, "
          f"system {result['system_ms']:.1f} ms")
    if args.json:
        args.json.write_text(json.dumps({**vars(args), "json": str(args.json), **result},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
