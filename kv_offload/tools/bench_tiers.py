"""Storage tiers against a baseline, measured side by side in one run: the harness behind
`kv-offload bench --tier filesystem|valkey|s3|module:Class`.

For every value size (``--page-kib``) and connection count (``--connections``; the filesystem
tier's ``io_threads``), each tier stores ``total_bytes`` of random values in jobs of
``values_per_job`` keys, all submitted at once, loads them back into a second host pool and
checks every byte. Then, on the same values: the latency of ``lookup`` (a batch of 64 keys,
from memory) and of a one-key load job (submit to result), p50 and p99. The baseline runs the
same cells in the same run: the filesystem tier for the shared stores (`bench_stores`), raw
O_DIRECT I/O of the same bytes for the filesystem tier (`bench_filesystem`). A reference
that is not the baseline (``redis-benchmark`` on the Valkey server) may run beside them.

Throughput is the best of ``repeats`` runs (each on a fresh tier, tiers alternating), and every
run's throughput stays in the JSON; latency percentiles pool every run's calls.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from kv_offload.backends.base import StorageTier
from kv_offload.tools.report import Progress, Table

MIB = 1 << 20
LOOKUP_BATCH = 64
LATENCY_SAMPLES = 50
GOAL = {"tier": "valkey", "value_mib": 4, "min_gbps": 1.0}  # on loopback

# make_tier(connections, workdir) -> a fresh tier
TierFactory = Callable[[int, str], StorageTier]


@dataclass(frozen=True)
class RawCell:
    """What a raw (tier-less) measurement gets: the cell and the same host pools."""

    value_bytes: int
    connections: int
    values: int
    source: torch.Tensor
    target: torch.Tensor
    workdir: str


# raw(cell) -> (store GB/s, load GB/s) of the medium alone
RawRunner = Callable[[RawCell], tuple[float, float]]


@dataclass(frozen=True)
class RawMeasure:
    name: str
    run: RawRunner


@dataclass(frozen=True)
class BenchTier:
    """A tier in the benchmark: how to open one, and whether to empty it after each run
    (False for a store that evicts on its own: a cache in service is full and warm, and
    emptying it would measure its allocator growing memory again instead)."""

    make: TierFactory
    clear_after: bool = True


@dataclass(frozen=True)
class BenchPlan:
    """The cells and how each is run."""

    page_bytes: tuple[int, ...]
    connections: tuple[int, ...]
    total_bytes: int
    values_per_job: Callable[[int], int]  # value bytes -> keys per job
    repeats: int = 3
    seed: int = 0
    work_root: str | None = None
    kv_like: bool = False  # values of bf16 Gaussians (compressible as KV is), not random bytes


@dataclass
class Cell:
    """One tier at one value size and connection count."""

    tier: str
    value_mib: float
    connections: int
    values: int
    values_per_job: int
    store_gbps: float
    load_gbps: float
    lookup_p50_us: float | None  # None: a raw measurement has no lookups or jobs
    lookup_p99_us: float | None
    load_p50_ms: float | None
    load_p99_ms: float | None
    mismatches: int
    failed_keys: int
    # While measuring: per call (latency, seconds); in a reported cell: per repeat (throughput).
    samples: dict[str, list[float]]
    page_bytes_written: int = 0  # the tier's stats over the stores of one repeat: the pages'
    record_bytes_written: int = 0  # bytes, and what it stored for them (compressed or not)


def run_tier_bench(subject: str, tiers: dict[str, BenchTier], plan: BenchPlan, *,
                   baseline: str, baseline_note: str, note: str = "",
                   raw: Sequence[RawMeasure] = ()) -> dict:
    """Run every cell ``plan.repeats`` times for every tier and raw measurement; return the
    JSON result (the figures of ``subject`` against those of ``baseline``)."""
    cells: list[Cell] = []
    run_ids = itertools.count()  # every run writes keys of its own: nothing is skipped
    progress = Progress(len(plan.page_bytes) * len(plan.connections) * plan.repeats,
                        f"bench {subject}")
    for size in plan.page_bytes:
        count = max(4, plan.total_bytes // size)
        per_job = plan.values_per_job(size)
        source = _pool(size * count, seed=plan.seed * 1_000_003 + size, kv_like=plan.kv_like)
        target = _pool(size * count)
        for conns in plan.connections:
            runs: dict[str, list[Cell]] = {name: [] for name in [*tiers, *(m.name for m in raw)]}
            for rep in range(plan.repeats):
                progress.step(f"{size / MIB:g} MiB values, {conns} connections, "
                              f"repeat {rep + 1}")
                for name, bench_tier in tiers.items():
                    with _workdir(plan.work_root) as workdir:
                        tier = bench_tier.make(conns, workdir)
                        try:
                            runs[name].append(_measure(name, tier, source, target, size, count,
                                                       conns, per_job, next(run_ids)))
                        finally:
                            if bench_tier.clear_after:
                                tier.clear()
                            tier.close()
                for measure in raw:
                    with _workdir(plan.work_root) as workdir:
                        store, load = measure.run(RawCell(size, conns, count, source, target,
                                                          workdir))
                    runs[measure.name].append(Cell(
                        measure.name, size / MIB, conns, count, per_job, store, load, None,
                        None, None, None, 0, 0, {"lookup": [], "load": []}))
            cells += [_best(samples) for samples in runs.values()]
        del source, target
    progress.finish()
    return _summarise(subject, baseline, baseline_note, cells, note, plan)


def _best(runs: list[Cell]) -> Cell:
    """Best throughput of the repeats; latencies over every repeat's samples."""
    def pct(kind: str, q: int, scale: float) -> float | None:
        return _pct(sum((r.samples[kind] for r in runs), []), q, scale)

    return replace(
        runs[0], store_gbps=max(r.store_gbps for r in runs),
        load_gbps=max(r.load_gbps for r in runs),
        lookup_p50_us=pct("lookup", 50, 1e6), lookup_p99_us=pct("lookup", 99, 1e6),
        load_p50_ms=pct("load", 50, 1e3), load_p99_ms=pct("load", 99, 1e3),
        mismatches=sum(r.mismatches for r in runs), failed_keys=sum(r.failed_keys for r in runs),
        samples={"store_gbps": [r.store_gbps for r in runs],
                 "load_gbps": [r.load_gbps for r in runs]})


def _pool(nbytes: int, seed: int | None = None, kv_like: bool = False) -> torch.Tensor:
    """A page-aligned host pool, as the CPU tier's (the filesystem tier then uses O_DIRECT);
    ``kv_like``: bf16 values of a unit Gaussian, which compress about as real KV pages do
    (benchmarks/bench_compression.py), instead of random bytes."""
    from kv_offload.backends.filesystem import aligned_host_buffer

    pool = aligned_host_buffer(nbytes)
    if seed is None:
        pool.fill_(0)  # touch every page before timing
    elif kv_like:
        gen = torch.Generator().manual_seed(seed)
        pool[: nbytes // 2 * 2].view(torch.bfloat16).copy_(
            torch.randn(nbytes // 2, generator=gen))
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
             chunk: int, count: int, conns: int, per_job: int, run_id: int) -> Cell:
    keys = [f"bench-{run_id}-{chunk}-{i}".encode() for i in range(count)]
    src = [source[i * chunk:(i + 1) * chunk] for i in range(count)]
    dst = [target[i * chunk:(i + 1) * chunk] for i in range(count)]
    before = tier.stats().counts
    store_s, failed = _run_jobs(tier, tier.submit_write, keys, src, per_job)
    after = tier.stats().counts
    written = {k: after.get(k, 0) - before.get(k, 0)
               for k in ("page_bytes_written", "record_bytes_written")}
    target.fill_(0)
    load_s, failed_loads = _run_jobs(tier, tier.submit_read, keys, dst, per_job)
    mismatches = sum(not torch.equal(s, d) for s, d in zip(src, dst))
    lookups = []
    batch = (keys * (LOOKUP_BATCH // len(keys) + 1))[:LOOKUP_BATCH]
    for _ in range(LATENCY_SAMPLES * 4):
        start = time.perf_counter()
        tier.lookup(batch)
        lookups.append(time.perf_counter() - start)
    loads = []
    for i in range(LATENCY_SAMPLES):
        one = i % count
        seconds, bad = _run_jobs(tier, tier.submit_read, keys[one:one + 1], dst[one:one + 1], 1)
        loads.append(seconds)
        failed_loads += bad
    total = chunk * count
    return Cell(name, chunk / MIB, conns, count, per_job, total / store_s / 1e9,
                total / load_s / 1e9, _pct(lookups, 50, 1e6), _pct(lookups, 99, 1e6),
                _pct(loads, 50, 1e3), _pct(loads, 99, 1e3), mismatches, failed + failed_loads,
                {"lookup": lookups, "load": loads}, **written)


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


def _summarise(name: str, baseline: str, baseline_note: str, cells: list[Cell], note: str,
               plan: BenchPlan) -> dict:
    """The JSON result: every cell, and the figures every tier reports (at 4 MiB values
    when measured, else over every size; at the best connection count)."""
    at4 = any(c.value_mib == 4 for c in cells)

    def best(tier: str, field: str) -> float:
        values = [getattr(c, field) for c in cells
                  if c.tier == tier and (c.value_mib == 4 or not at4)]
        return max(values, default=0.0)

    store, load = best(name, "store_gbps"), best(name, "load_gbps")
    base_s, base_l = best(baseline, "store_gbps"), best(baseline, "load_gbps")
    result = {
        "tier": name, "note": note, "repeats": plan.repeats, "seed": plan.seed,
        "total_bytes": plan.total_bytes,
        "summary_at": "4 MiB values" if at4 else "every value size",
        "store_gbps": store, "load_gbps": load,
        "baseline": baseline_note,
        "baseline_store_gbps": base_s, "baseline_load_gbps": base_l,
        "store_ratio": store / base_s if base_s else None,
        "load_ratio": load / base_l if base_l else None,
        "mismatches": sum(c.mismatches for c in cells),
        "failed_keys": sum(c.failed_keys for c in cells),
        "cells": [asdict(c) for c in cells],
    }
    if name == GOAL["tier"]:  # both directions at one connection count
        at_goal = [c for c in cells if c.tier == name and c.value_mib == GOAL["value_mib"]]
        got = max((min(c.store_gbps, c.load_gbps) for c in at_goal), default=0.0)
        result["goal"] = {**GOAL, "measured_gbps": got, "met": got >= GOAL["min_gbps"]}
    return result


def tier_table(r: dict) -> Table:
    table = Table(f"kv-offload bench: tier={r['tier']} vs {r['baseline']}, same run, "
                  f"GB/s best of {r['repeats']}" + (f" ({r['note']})" if r["note"] else ""),
                  ("tier", "value MiB", "conns", "keys/job", "store GB/s", "load GB/s",
                   "lookup p50 us", "lookup p99 us", "load p50 ms", "load p99 ms",
                   "stored/page", "bad"))
    for c in r["cells"]:
        stored = c["record_bytes_written"] / c["page_bytes_written"] \
            if c.get("page_bytes_written") else None
        table.add(c["tier"], f"{c['value_mib']:g}", c["connections"], c["values_per_job"],
                  c["store_gbps"], c["load_gbps"], c["lookup_p50_us"], c["lookup_p99_us"],
                  c["load_p50_ms"], c["load_p99_ms"], stored, c["mismatches"] + c["failed_keys"])
    ratio = ", ".join(f"{d} {r[f'{d}_ratio']:.2f}x" for d in ("store", "load")
                      if r[f"{d}_ratio"] is not None)
    table.notes.append(f"{r['tier']} / baseline ({r['summary_at']}, best connection "
                       f"count): {ratio}")
    table.notes.append(f"mismatches: {r['mismatches']}   failed keys: {r['failed_keys']}")
    if "goal" in r:
        g = r["goal"]
        table.notes.append(
            f"goal: >= {g['min_gbps']} GB/s with {g['value_mib']} MiB values (the slower of "
            f"store and load, at the best connection count): {g['measured_gbps']:.2f} GB/s, "
            f"{'met' if g['met'] else 'NOT met'}")
    return table
