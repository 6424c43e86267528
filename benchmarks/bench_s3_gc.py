"""What an `S3Tier` costs the engine process's garbage collector (issue 25: full collections).

An engine process holds a large tracked heap (here ``--heap`` million small containers,
frozen as vLLM freezes its start-up heap, or not with ``--no-freeze``) and allocates
while it steps (the main thread: ``--churn`` short-lived containers every 2 ms). Beside it,
a real `S3Tier` over a moto server in another process (`s3_bucket_server.py`, holding
``--objects`` objects) does one of:

- ``neither``: nothing (no crawl, no jobs): the engine's own collections;
- ``listing``: its paced listing crawl (``list_pages_per_refresh`` pages every 1 s);
- ``puts``: ``--put-rate`` PUTs per second of ``--block-kib`` KiB blocks, no crawl;
- ``both``.

Each mode runs ``--seconds`` in a child process of its own (a fresh heap, the same
thresholds), and reports its collections per generation (count, wall and CPU time in all,
the longest), the objects promoted into the old generation (the growth of
``gc.get_objects(generation=2)`` across each generation-1 collection: what CPython 3.11
counts towards its next full collection, which runs once those exceed a quarter of the
old generation), per listing page and per PUT, and the old generation's size at each full
collection (its cost).

    python benchmarks/bench_s3_gc.py --objects 100000 --seconds 60 --json s3-gc.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import torch

MODES = ("neither", "listing", "puts", "both")


class GcLog:
    """Collections by generation, and the objects each generation-1 collection promoted."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.wall_ns = [0, 0, 0]
        self.cpu_ns = [0, 0, 0]
        self.max_ns = [0, 0, 0]
        self.promoted = 0
        self.old_sizes: list[int] = []  # unfrozen gen2 size at each full collection
        self._start = self._cpu = self._old = 0
        gc.callbacks.append(self._callback)

    def close(self) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        generation = info["generation"]
        if phase == "start":
            if generation == 1:
                self._old = len(gc.get_objects(generation=2))
            elif generation == 2:
                self.old_sizes.append(len(gc.get_objects(generation=2)))
            self._start, self._cpu = time.perf_counter_ns(), time.thread_time_ns()
            return
        wall = time.perf_counter_ns() - self._start
        self.count[generation] += 1
        self.wall_ns[generation] += wall
        self.cpu_ns[generation] += time.thread_time_ns() - self._cpu
        self.max_ns[generation] = max(self.max_ns[generation], wall)
        if generation == 1:
            self.promoted += len(gc.get_objects(generation=2)) - self._old


def run_mode(args) -> dict:
    """One mode, in this process (a child of `main`)."""
    from kv_offload.backends.s3 import S3Tier
    from kv_offload.backends.s3.local_server import TEST_CREDENTIALS

    os.environ.update(TEST_CREDENTIALS)
    listing = args.mode in ("listing", "both")
    puts = args.mode in ("puts", "both")
    heap = [[i, {"a": i}] for i in range(args.heap * 1_000_000 // 3)]  # ~3 objects each
    tier = S3Tier.from_options({
        "bucket": args.bucket, "bytes_to_use": "64GiB", "prefix": args.prefix,
        "endpoint_url": args.endpoint_url, "refresh_interval_s": 1.0 if listing else 0,
        "list_pages_per_refresh": args.pages_per_refresh}, args.fingerprint)
    if args.freeze:  # as vLLM does once its engine is up (vllm.utils.gc_utils)
        for generation in range(3):
            gc.collect(generation)
        gc.freeze()
    log = GcLog()
    stop = threading.Event()
    written = [0]

    def writer() -> None:
        block = torch.randint(0, 256, (args.block_kib << 10,), dtype=torch.uint8)
        rng = random.Random(1)
        period = 1.0 / args.put_rate
        jobs: set[int] = set()
        next_at = time.monotonic()
        while not stop.is_set():
            jobs.add(tier.submit_write([rng.randbytes(32)], [block]))
            for result in tier.poll():
                jobs.discard(result.job_id)
                written[0] += all(result.succeeded)
            next_at += period
            time.sleep(max(0.0, next_at - time.monotonic()))

    thread = threading.Thread(target=writer, daemon=True)
    if puts:
        thread.start()
    pages_before = tier.stats().counts.get("listing_pages", 0)
    recent: deque = deque(maxlen=2000)  # the engine's short-lived objects (a few steps)
    started = time.monotonic()
    steps = 0
    while time.monotonic() - started < args.seconds:
        recent.extend({"step": steps, "i": i, "t": [i]} for i in range(args.churn))
        steps += 1
        time.sleep(0.002)
    stop.set()
    if puts:
        thread.join()
    log.close()
    pages = tier.stats().counts.get("listing_pages", 0) - pages_before
    tier.close()
    del heap
    return {"mode": args.mode, "seconds": args.seconds, "steps": steps, "pages": pages,
            "puts": written[0], "collections": log.count,
            "wall_ms": [n / 1e6 for n in log.wall_ns], "cpu_ms": [n / 1e6 for n in log.cpu_ns],
            "max_ms": [n / 1e6 for n in log.max_ns], "promoted": log.promoted,
            "old_gen_at_full": log.old_sizes, "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--heap", type=int, default=3, help="million tracked objects")
    parser.add_argument("--churn", type=int, default=50, help="containers per 2 ms step")
    parser.add_argument("--pages-per-refresh", type=int, default=10)
    parser.add_argument("--put-rate", type=float, default=50.0)
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--no-freeze", dest="freeze", action="store_false")
    parser.add_argument("--json")
    # (the child's own)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint-url", help=argparse.SUPPRESS)
    parser.add_argument("--bucket", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--fingerprint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:
        print(json.dumps(run_mode(args)))
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    from step_cost_s3 import BUCKET, PREFIX, S3BucketServer
    from step_cost_shared import FINGERPRINT

    from kv_offload.backends.s3.local_server import TEST_CREDENTIALS

    os.environ.update(TEST_CREDENTIALS)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        names, records = Path(tmp) / "names.txt", Path(tmp) / "records.txt"
        names.write_text("".join(f"{rng.randbytes(32).hex()}\n" for _ in range(args.objects)))
        records.write_text("")
        server = S3BucketServer(names, records, 1)
    results = []
    with server:
        for mode in args.modes:
            child = [sys.executable, __file__, "--mode", mode, "--endpoint-url",
                     server.endpoint_url, "--bucket", BUCKET, "--prefix", PREFIX,
                     "--fingerprint", FINGERPRINT, *(argv if argv is not None else sys.argv[1:])]
            out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            results.append(result)
            print_row(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "results": results}, f, indent=2)
    return 0


def print_row(r: dict) -> None:
    per_page = r["promoted"] / r["pages"] if r["pages"] else float("nan")
    print(f"{r['mode']:8} pages {r['pages']:4} puts {r['puts']:5} | collections gen0/1/2 "
          f"{r['collections'][0]}/{r['collections'][1]}/{r['collections'][2]} | full: "
          f"{r['wall_ms'][2]:.0f} ms wall ({r['cpu_ms'][2]:.0f} cpu), longest "
          f"{r['max_ms'][2]:.0f} ms | promoted to gen2 {r['promoted']} "
          f"({per_page:.0f}/page) | old gen at full {r['old_gen_at_full'][:6]} | load "
          f"{r['load_average'][0]:.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
