"""What listing the S3 tier's prefix costs the engine's process: per object, per poll, and
what a lookup waits meanwhile, with N objects in moto's S3 server on loopback.

    python benchmarks/bench_s3_listing.py --objects 20000 --json s3-listing.json

moto answers a listing page in ~0.1-0.3 s and stores objects one PUT at a time, so a million
objects is out of reach here: this measures the client-side cost per listed object (the
process CPU of this process, moto runs in a child) and extrapolates it, and measures the
end-of-pass bookkeeping (``ServerKeys.drop_unseen``) with a real million keys in memory.

Rows:
- `idle`: the probe with nothing listing (the floor: on a loaded host, the host's own noise).
- `full listing` (``S3Tier.refresh``: what the tier did every 30 s before issue 25): CPU per
  object, and the lookups of a probe thread meanwhile (one ``lookup([key])`` every ~200 us:
  how late each returns, i.e. the wait for the interpreter lock and the index lock).
- `one poll` (``S3Tier.poll_listing``: one page of 1000 objects, what the background thread
  now does every ``refresh_interval_s``): CPU and wall per poll, and the probe meanwhile.
- `steady crawl`: the tier's own thread polling once a second, the probe over ``--steady-s``
  seconds (what an engine sees between its steps).
- `end of a pass, 1M keys`: ``drop_unseen`` over a million other writers' keys (10k vanished):
  the probe's p99/max while it runs.
- per million objects: the CPU a full listing costs, and what the crawl costs per second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kv_offload.tools.report import Table, emit, envelope

FINGERPRINT = "bench|LBHNC|page=65536|tp1|rank0"
PROBE_SLEEP_S = 0.0002


class Probe:
    """A thread calling ``lookup`` every ~200 us and recording how late each call returns."""

    def __init__(self, lookup) -> None:
        self._lookup = lookup
        self._stop = threading.Event()
        self.lateness: list[float] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            due = time.perf_counter() + PROBE_SLEEP_S
            time.sleep(PROBE_SLEEP_S)
            self._lookup()
            self.lateness.append(time.perf_counter() - due)

    def summary(self) -> dict[str, float]:
        xs = sorted(self.lateness) or [0.0]
        return {"samples": len(xs), "p50_ms": 1e3 * xs[len(xs) // 2],
                "p99_ms": 1e3 * xs[min(len(xs) - 1, int(len(xs) * 0.99))],
                "max_ms": 1e3 * xs[-1]}


def _fill(endpoint: str, bucket: str, root: str, n: int) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket=bucket)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: s3.put_object(Bucket=bucket, Key=f"{root}{i:064x}",
                                              Body=b"x"), range(n)))


def _timed(fn) -> tuple[float, float]:
    """(CPU of the calling thread, wall) of ``fn()`` (the probe's CPU is not counted)."""
    cpu, wall = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - cpu, time.perf_counter() - wall


def _drop_unseen_at_a_million() -> dict[str, float]:
    from kv_offload.backends.common.server_keys import ServerKeys

    keys = [i.to_bytes(16, "big") for i in range(1_000_000)]
    view = ServerKeys()
    view.add(keys)
    view.take_changes(2_000_000)
    generation = view.begin_scan()
    seen = set(keys[10_000:])
    probe_key = [keys[-1]]
    with Probe(lambda: view.contains(probe_key)) as probe:
        cpu, wall = _timed(lambda: view.drop_unseen(seen.__contains__, generation))
    return {"cpu_s": cpu, "wall_s": wall, **probe.summary()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=20_000)
    parser.add_argument("--polls", type=int, default=5)
    parser.add_argument("--steady-s", type=float, default=20.0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    from kv_offload.backends.record import CHECKSUM
    from kv_offload.backends.s3 import S3Tier
    from kv_offload.backends.s3.local_server import TEST_CREDENTIALS, LocalS3Server

    os.environ.update({k: os.environ.get(k, v) for k, v in TEST_CREDENTIALS.items()})
    server = LocalS3Server()
    try:
        bucket, prefix = "kv-bench-listing", "kv-offload/"
        root = f"{prefix}{CHECKSUM.namespace(FINGERPRINT)}/"
        t0 = time.perf_counter()
        _fill(server.endpoint_url, bucket, root, args.objects)
        fill_s = time.perf_counter() - t0
        tier = S3Tier.from_options({"bucket": bucket, "endpoint_url": server.endpoint_url,
                                    "bytes_to_use": 1 << 30, "refresh_interval_s": 0,
                                    "list_pages_per_refresh": 1}, FINGERPRINT)
        probe_key = [bytes.fromhex(f"{args.objects - 1:064x}")]
        assert tier.lookup(probe_key) == [True]
        with Probe(lambda: tier.lookup(probe_key)) as probe:
            time.sleep(args.steady_s / 2)
        idle = probe.summary()  # the floor: the probe with nothing else running
        fulls = []
        for _ in range(3):
            with Probe(lambda: tier.lookup(probe_key)) as probe:
                cpu, wall = _timed(tier.refresh)
            fulls.append({"cpu_s": cpu, "wall_s": wall, **probe.summary()})
        polls = []
        for _ in range(args.polls):
            with Probe(lambda: tier.lookup(probe_key)) as probe:
                cpu, wall = _timed(tier.poll_listing)
            polls.append({"cpu_s": cpu, "wall_s": wall, **probe.summary()})
        tier.close()
        # The steady state: the background thread polls every second while the probe runs.
        crawling = S3Tier.from_options({"bucket": bucket, "endpoint_url": server.endpoint_url,
                                        "bytes_to_use": 1 << 30, "refresh_interval_s": 1.0,
                                        "list_pages_per_refresh": 1}, FINGERPRINT)
        with Probe(lambda: crawling.lookup(probe_key)) as probe:
            time.sleep(args.steady_s)
        steady = {"seconds": args.steady_s, "pages": crawling.stats()["listing_pages"],
                  **probe.summary()}
        crawling.close()
    finally:
        server.stop()
    drop = _drop_unseen_at_a_million()

    def med(rows, field):
        return statistics.median(r[field] for r in rows)

    per_object_us = 1e6 * med(fulls, "cpu_s") / args.objects
    table = Table(f"S3 prefix listing, {args.objects} objects in moto (medians)",
                  ["what", "CPU ms", "wall ms", "lookup p50 ms", "p99 ms", "max ms"])
    table.add("idle (nothing listing)", "", "", f"{idle['p50_ms']:.3f}",
              f"{idle['p99_ms']:.3f}", f"{idle['max_ms']:.2f}")
    for name, rows in (("full listing", fulls), ("one poll (1 page)", polls)):
        table.add(name, f"{1e3 * med(rows, 'cpu_s'):.1f}", f"{1e3 * med(rows, 'wall_s'):.1f}",
                  f"{med(rows, 'p50_ms'):.3f}", f"{med(rows, 'p99_ms'):.3f}",
                  f"{med(rows, 'max_ms'):.2f}")
    table.add(f"steady crawl, {args.steady_s:.0f} s (1 page/s)", "", "",
              f"{steady['p50_ms']:.3f}", f"{steady['p99_ms']:.3f}", f"{steady['max_ms']:.2f}")
    table.add("end of a pass, 1M keys", f"{1e3 * drop['cpu_s']:.1f}",
              f"{1e3 * drop['wall_s']:.1f}", f"{drop['p50_ms']:.3f}", f"{drop['p99_ms']:.3f}",
              f"{drop['max_ms']:.2f}")
    table.notes += [
        f"client CPU per listed object: {per_object_us:.1f} us -> a full listing of 1M "
        f"objects: {per_object_us:.0f} CPU-s (before: every 30 s)",
        f"the crawl (1 page per refresh_interval_s = 1 s): {per_object_us * 1000 / 1e6:.3f} "
        f"CPU-s per second whatever the prefix holds; a pass over 1M objects: 1000 s",
        f"fill: {fill_s:.0f} s; load average {os.getloadavg()[0]:.1f} (2 shared cores)"]
    emit([table], envelope("bench_s3_listing", {
        "objects": args.objects, "full_listing": fulls, "polls": polls,
        "idle": idle, "steady": steady, "drop_unseen_1M": drop, "cpu_us_per_object": per_object_us},
        "median"), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
