"""Shared-store tiers against the filesystem tier, measured side by side in one run.

For every value size (1, 4, 16 MiB by default) and connection count (1, 4, 8; the
filesystem tier's ``io_threads``), each tier writes ``total_mib`` of random values in jobs of
``keys_per_job`` keys, all submitted at once, reads them back into a second host pool and
checks every byte. Then, on the same values: the latency of ``lookup`` (a batch of 64 keys,
from memory) and of a one-key read job (submit to result), p50 and p99. The filesystem tier
runs the same cells in the same run: its numbers are the baseline of the ratios.

    kv-offload bench --backend valkey   # a loopback redis-server/valkey-server is started
    kv-offload bench --backend valkey --url redis://HOST:6379/0
    kv-offload bench --backend s3       # moto's server on loopback: NOT a performance reference
    kv-offload bench --backend s3 --endpoint-url http://minio:9000 --bucket kv-bench

Loopback numbers measure the client, the server and the memory copies on this machine, not
a network.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kv_offload.backends.base import StorageTier

MIB = 1 << 20
LOOKUP_BATCH = 64
LATENCY_SAMPLES = 50
GOAL = {"backend": "valkey", "value_mib": 4, "min_gbps": 1.0}  # on loopback

# make_tier(connections, workdir) -> a fresh tier
TierFactory = Callable[[int, str], StorageTier]
# raw(value_bytes, connections, values) -> (write GB/s, read GB/s) of the store alone
RawBaseline = Callable[[int, int, int], tuple[float, float]]


@dataclass(frozen=True)
class BenchTier:
    """A tier in the benchmark: how to open one, and whether to empty it after each run
    (False for a store that evicts on its own: a cache in service is full and warm, and
    emptying it would measure its allocator growing memory again instead)."""

    make: TierFactory
    clear_after: bool = True


@dataclass
class Cell:
    """One tier at one value size and connection count."""

    tier: str
    value_mib: float
    connections: int
    values: int
    write_gbps: float
    read_gbps: float
    lookup_p50_us: float | None  # None: a raw baseline has no lookups or jobs
    lookup_p99_us: float | None
    read_p50_ms: float | None
    read_p99_ms: float | None
    mismatches: int
    failed_keys: int
    samples: dict[str, list[float]]  # per repeat (throughput) or per call (latency, seconds)


def run_tier_bench(backend: str, tiers: dict[str, BenchTier], *,
                   value_mib: tuple[float, ...] = (1, 4, 16),
                   connections: tuple[int, ...] = (1, 4, 8), total_mib: int = 256,
                   keys_per_job: int = 4, repeats: int = 3, work_root: str | None = None,
                   note: str = "", raw: tuple[str, RawBaseline] | None = None) -> dict:
    """Run every cell ``repeats`` times for every tier (alternating tiers, each time a fresh
    tier) and for the ``raw`` (name, runner) baseline if given; keep the best throughput and
    pool the latency samples; print the table; return the JSON result."""
    cells: list[Cell] = []
    run_ids = itertools.count()  # every run writes keys of its own: nothing is skipped
    for size in value_mib:
        chunk = int(size * MIB)
        count = max(4, int(total_mib * MIB) // chunk)
        source, target = _pool(chunk * count, seed=int(size * 1000)), _pool(chunk * count)
        for conns in connections:
            runs: dict[str, list[Cell]] = {name: [] for name in tiers}
            for _ in range(repeats):
                for name, bench_tier in tiers.items():
                    with _workdir(work_root) as workdir:
                        tier = bench_tier.make(conns, workdir)
                        try:
                            runs[name].append(_measure(name, tier, source, target, chunk, count,
                                                       conns, keys_per_job, next(run_ids)))
                        finally:
                            if bench_tier.clear_after:
                                tier.clear()
                            tier.close()
                if raw is not None:
                    write, read = raw[1](chunk, conns, count)
                    runs.setdefault(raw[0], []).append(Cell(
                        raw[0], chunk / MIB, conns, count, write, read, None, None, None, None,
                        0, 0, {"lookup": [], "read": []}))
            cells += [_best(samples) for samples in runs.values()]
        del source, target
    result = _summarise(backend, cells, note, repeats)
    print(format_tier_table(result))
    return result


def _best(runs: list[Cell]) -> Cell:
    """Best throughput of the repeats; latencies over every repeat's samples."""
    first = runs[0]
    return Cell(first.tier, first.value_mib, first.connections, first.values,
                max(r.write_gbps for r in runs), max(r.read_gbps for r in runs),
                *(_pct(sum((r.samples[k] for r in runs), []), q, scale)
                  for k, q, scale in (("lookup", 50, 1e6), ("lookup", 99, 1e6),
                                      ("read", 50, 1e3), ("read", 99, 1e3))),
                sum(r.mismatches for r in runs), sum(r.failed_keys for r in runs),
                {"write_gbps": [r.write_gbps for r in runs],
                 "read_gbps": [r.read_gbps for r in runs]})


def _pool(nbytes: int, seed: int | None = None) -> torch.Tensor:
    """A page-aligned host pool, as the CPU tier's (the filesystem tier then uses O_DIRECT)."""
    from kv_offload.backends.filesystem import aligned_host_buffer

    pool = aligned_host_buffer(nbytes)
    if seed is None:
        pool.fill_(0)  # touch every page before timing
    else:
        pool.copy_(torch.from_numpy(np.random.default_rng(seed).integers(
            0, 256, nbytes, dtype=np.uint8)))
    return pool


@contextlib.contextmanager
def _workdir(root: str | None) -> Iterator[str]:
    if root is not None:
        os.makedirs(root, exist_ok=True)
    path = tempfile.mkdtemp(prefix="kv-offload-tier-bench-", dir=root)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _measure(name: str, tier: StorageTier, source: torch.Tensor, target: torch.Tensor,
             chunk: int, count: int, conns: int, keys_per_job: int, run_id: int) -> Cell:
    keys = [f"bench-{run_id}-{chunk}-{i}".encode() for i in range(count)]
    src = [source[i * chunk:(i + 1) * chunk] for i in range(count)]
    dst = [target[i * chunk:(i + 1) * chunk] for i in range(count)]
    write_s, failed = _run_jobs(tier, tier.submit_write, keys, src, keys_per_job)
    target.fill_(0)
    read_s, failed_reads = _run_jobs(tier, tier.submit_read, keys, dst, keys_per_job)
    mismatches = sum(not torch.equal(s, d) for s, d in zip(src, dst))
    lookups = []
    batch = (keys * (LOOKUP_BATCH // len(keys) + 1))[:LOOKUP_BATCH]
    for _ in range(LATENCY_SAMPLES * 4):
        start = time.perf_counter()
        tier.lookup(batch)
        lookups.append(time.perf_counter() - start)
    reads = []
    for i in range(LATENCY_SAMPLES):
        one = i % count
        seconds, bad = _run_jobs(tier, tier.submit_read, keys[one:one + 1], dst[one:one + 1], 1)
        reads.append(seconds)
        failed_reads += bad
    total = chunk * count
    return Cell(name, chunk / MIB, conns, count, total / write_s / 1e9, total / read_s / 1e9,
                _pct(lookups, 50, 1e6), _pct(lookups, 99, 1e6), _pct(reads, 50, 1e3),
                _pct(reads, 99, 1e3), mismatches, failed + failed_reads,
                {"lookup": lookups, "read": reads})


def _run_jobs(tier: StorageTier, submit, keys, views, per_job: int) -> tuple[float, int]:
    """Submit every key in jobs of ``per_job``; wait for all; (seconds, failed keys)."""
    start = time.perf_counter()
    pending = {submit(keys[i:i + per_job], views[i:i + per_job])
               for i in range(0, len(keys), per_job)}
    failed = 0
    while pending:
        for result in tier.poll():
            pending.discard(result.job_id)
            failed += len(result.failed_keys)
        time.sleep(0.0002)
    return time.perf_counter() - start, failed


def _pct(samples: list[float], q: int, scale: float) -> float | None:
    return float(np.percentile(samples, q)) * scale if samples else None


def _summarise(backend: str, cells: list[Cell], note: str, repeats: int) -> dict:
    """The JSON result: every cell, and the keys the other backends report (at 4 MiB with
    the best connection count; the filesystem tier is the baseline)."""
    def best(tier: str, field: str) -> float:
        at4 = [getattr(c, field) for c in cells if c.tier == tier and c.value_mib == 4] or \
              [getattr(c, field) for c in cells if c.tier == tier]
        return max(at4) if at4 else 0.0

    write, read = best(backend, "write_gbps"), best(backend, "read_gbps")
    base_w, base_r = best("filesystem", "write_gbps"), best("filesystem", "read_gbps")
    result = {
        "backend": backend, "note": note, "repeats": repeats,
        "throughput": f"best of {repeats} (a fresh tier each time)",
        "write_gbps": write, "read_gbps": read,
        "baseline": "the filesystem tier, same cells, same run",
        "baseline_write_gbps": base_w, "baseline_read_gbps": base_r,
        "write_ratio": write / base_w if base_w else None,
        "read_ratio": read / base_r if base_r else None,
        "mismatches": sum(c.mismatches for c in cells),
        "failed_keys": sum(c.failed_keys for c in cells),
        "cells": [asdict(c) for c in cells],
    }
    if backend == GOAL["backend"]:  # both directions at one connection count
        at_goal = [c for c in cells if c.tier == backend and c.value_mib == GOAL["value_mib"]]
        got = max((min(c.write_gbps, c.read_gbps) for c in at_goal), default=0.0)
        result["goal"] = {**GOAL, "measured_gbps": got, "met": got >= GOAL["min_gbps"]}
    return result


def format_tier_table(r: dict) -> str:
    lines = [f"kv-offload bench: backend={r['backend']} vs the filesystem tier, same run, "
             f"GB/s best of {r['repeats']}" + (f" ({r['note']})" if r["note"] else ""),
             f"{'tier':<16}{'value':>7}{'conns':>6}{'write GB/s':>11}{'read GB/s':>10}"
             f"{'lookup p50/p99 us':>19}{'read p50/p99 ms':>17}{'bad':>5}"]
    for c in r["cells"]:
        lookup = read = f"{'-':>8} {'':8}"
        if c["lookup_p50_us"] is not None:
            lookup = f"{c['lookup_p50_us']:>10.1f}/{c['lookup_p99_us']:<8.1f}"
            read = f"{c['read_p50_ms']:>8.2f}/{c['read_p99_ms']:<8.2f}"
        lines.append(
            f"{c['tier']:<16}{c['value_mib']:>5g}Mi{c['connections']:>6}"
            f"{c['write_gbps']:>11.2f}{c['read_gbps']:>10.2f}{lookup}{read}"
            f"{c['mismatches'] + c['failed_keys']:>4}")
    lines.append(f"mismatches: {r['mismatches']}   failed keys: {r['failed_keys']}")
    if "goal" in r:
        g = r["goal"]
        lines.append(f"goal: >= {g['min_gbps']} GB/s with {g['value_mib']} MiB values "
                     f"(the slower of write and read, at the best connection count): "
                     f"{g['measured_gbps']:.2f} "
                     f"GB/s, {'met' if g['met'] else 'NOT met'}")
    return "\n".join(lines)


def filesystem_factory(conns: int, workdir: str) -> StorageTier:
    """The filesystem tier as the bench baseline, in a fresh directory under --fs-root."""
    from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig

    return FilesystemTier(FilesystemTierConfig(workdir, "bench-layout", 1 << 40,
                                               io_threads=conns, rescan_interval_s=0))


def run_shared_store_bench(args) -> dict:
    """`kv-offload bench --backend valkey|s3`: start a loopback server unless one is named."""
    with contextlib.ExitStack() as stack:
        if args.backend == "valkey":
            make, note = _valkey_factory(args, stack)
        else:
            make, note = _s3_factory(args, stack)
        raw = None
        if args.backend == "valkey" and args.url is None:
            raw = _server_alone(make)
        # Our own Valkey server evicts on its own; a server named by --url is cleaned up.
        keep = args.backend == "valkey" and args.url is None
        tiers = {args.backend: BenchTier(make, clear_after=not keep),
                 "filesystem": BenchTier(filesystem_factory)}
        result = run_tier_bench(
            args.backend, tiers,
            value_mib=tuple(args.value_mib), connections=tuple(args.connections),
            total_mib=args.total_mib, repeats=args.repeats, work_root=args.fs_root, note=note,
            raw=raw)
    return result


def fill_until_evicting(url: str, value_bytes: int = 16 * MIB) -> None:
    """Write filler values until the server starts evicting (its memory is then all in use)."""
    import redis

    client = redis.Redis.from_url(url)
    filler = bytes(value_bytes)
    for i in itertools.count():
        client.set(f"kv-offload-bench-fill:{i}", filler)
        if client.info("stats")["evicted_keys"] > 0:
            return


def _server_alone(make) -> tuple[str, RawBaseline] | None:
    """redis-benchmark on the bench's own server, if the binary is there."""
    from kv_offload.tools.bench_valkey_server import benchmark_binary, server_alone_gbps

    binary = benchmark_binary()
    if binary is None:
        return None
    port = make.server.port
    return (os.path.basename(binary),
            lambda size, conns, count: server_alone_gbps(binary, port, size, conns, count))


def _valkey_factory(args, stack: contextlib.ExitStack) -> tuple[TierFactory, str]:
    from kv_offload.backends.valkey import ValkeyTier

    url, note, server = args.url, f"server {args.url}", None
    if url is None:
        from kv_offload.backends.valkey.local_server import LocalServer

        # Room for four cells; filled first, so the benchmark runs on a full, warm cache
        # that evicts (LRU) as a server in service does.
        server = stack.enter_context(LocalServer(maxmemory=f"{4 * args.total_mib}mb"))
        fill_until_evicting(server.url)
        url = server.url
        note = f"local {os.path.basename(server.binary)} on loopback, full and evicting"

    def make(conns: int, workdir: str) -> StorageTier:
        return ValkeyTier.from_options({"url": url, "connections": conns,
                                        "key_prefix": f"kv-offload-bench-{os.getpid()}:",
                                        "timeout_s": 30.0, "refresh_interval_s": 0},
                                       "bench-layout")
    make.server = server  # (the raw baseline runs on the same server)
    return make, note


def _s3_factory(args, stack: contextlib.ExitStack) -> tuple[TierFactory, str]:
    from kv_offload.backends.s3 import S3Tier

    endpoint, bucket = args.endpoint_url, args.bucket
    note = f"endpoint {endpoint}, bucket {bucket}"
    if endpoint is None:
        import boto3

        from kv_offload.backends.s3.local_server import TEST_CREDENTIALS, LocalS3Server

        for name, value in TEST_CREDENTIALS.items():
            os.environ.setdefault(name, value)
        server = stack.enter_context(LocalS3Server())
        endpoint, bucket = server.endpoint_url, bucket or "kv-offload-bench"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        note = "moto's S3 server on loopback: a correctness reference, not a performance one"
    if bucket is None:
        raise SystemExit("--bucket is required with --endpoint-url")

    def make(conns: int, workdir: str) -> StorageTier:
        return S3Tier.from_options({"bucket": bucket, "endpoint_url": endpoint,
                                    "bytes_to_use": 1 << 40, "connections": conns,
                                    "prefix": f"kv-offload-bench-{os.getpid()}/",
                                    "timeout_s": 60.0, "refresh_interval_s": 0},
                                   "bench-layout")
    return make, note
