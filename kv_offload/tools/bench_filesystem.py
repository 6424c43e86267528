"""`kv-offload bench --tier filesystem`: the filesystem tier against raw O_DIRECT I/O of
the same bytes, measured side by side in one run (`bench_tiers` runs the cells).

The raw baseline moves each cell's values to and from one file with sequential
``pwritev``/``preadv`` (O_DIRECT where `probe_direct_io` says the directory supports it, the
same probe the tier uses), and keeps the better of two request sizes (the value size, and
64 MiB), so the ratio is not flattered by a weak baseline. It is one thread: its numbers do
not change with ``--connections`` (the tier's io threads).

Use a directory on a real disk (``--fs-root``): tmpfs (/dev/shm) measures memory copies.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from kv_offload.backends.filesystem.io_engine import (
    O_DIRECT,
    host_view,
    preadv_upto,
    probe_direct_io,
    pwritev_all,
)
from kv_offload.tools.bench_stores import filesystem_factory, plan_from_args, with_record_modes
from kv_offload.tools.bench_tiers import MIB, BenchTier, RawCell, RawMeasure, run_tier_bench

BIG_REQUEST = 64 * MIB
DEFAULT_PAGE_KIB = (2048,)
DEFAULT_CONNECTIONS = (8,)
VALUES_PER_JOB = 16  # without --batch-mib
RAW = "raw disk"


def run_filesystem_bench(args: argparse.Namespace) -> dict:
    plan = plan_from_args(args, DEFAULT_PAGE_KIB, DEFAULT_CONNECTIONS, VALUES_PER_JOB)
    result = run_tier_bench(
        "filesystem", with_record_modes({"filesystem": BenchTier(filesystem_factory)},
                                        args.record_modes, args.compression), plan,
        baseline=RAW, baseline_note="raw sequential pwritev/preadv of one file, best of the "
                                    "value size and 64 MiB requests",
        raw=[RawMeasure(RAW, raw_disk)])
    probe_root = plan.work_root
    os.makedirs(probe_root, exist_ok=True)
    result["direct_io"] = probe_direct_io(os.path.join(probe_root, f".probe-{os.getpid()}"))
    result["root"] = os.path.abspath(probe_root)
    return result


def raw_disk(cell: RawCell) -> tuple[float, float]:
    """(store GB/s, load GB/s) of the cell's bytes written to and read from one file."""
    path = os.path.join(cell.workdir, "raw.bin")
    direct = probe_direct_io(os.path.join(cell.workdir, "probe"))
    total = cell.value_bytes * cell.values
    store = min(_raw_write(path, cell.source, r, direct) for r in (cell.value_bytes, BIG_REQUEST))
    load = min(_raw_read(path, cell.target, r, direct) for r in (cell.value_bytes, BIG_REQUEST))
    return total / store / 1e9, total / load / 1e9


def _raw_write(path: str, pool: torch.Tensor, request: int, direct: bool) -> float:
    return _raw_io(path, pool, request, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct,
                   lambda fd, chunk, offset: pwritev_all(fd, [chunk], offset))


def _raw_read(path: str, pool: torch.Tensor, request: int, direct: bool) -> float:
    def read(fd: int, chunk: memoryview, offset: int) -> None:
        if preadv_upto(fd, [chunk], offset, len(chunk)) != len(chunk):
            raise OSError(f"{path}: short read at {offset}")

    return _raw_io(path, pool, request, os.O_RDONLY, direct, read)


def _raw_io(path: str, pool: torch.Tensor, request: int, flags: int, direct: bool,
            move) -> float:
    """Seconds to move the whole pool to or from one file in `request`-byte calls (the same
    whole-buffer loops the tier's I/O engine uses)."""
    view = host_view(pool)
    start = time.perf_counter()
    fd = os.open(path, flags | (O_DIRECT if direct else 0), 0o644)
    try:
        for offset in range(0, len(view), request):
            move(fd, view[offset:offset + request], offset)
    finally:
        os.close(fd)
    return time.perf_counter() - start

