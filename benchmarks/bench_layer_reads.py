"""Would reading a disk hit layer by layer let the forward start sooner? (issue 23)

A disk hit of bench_ttft's Llama-like model is 62 block files of 256 KiB (8 layers of
32 KiB each, after a 4 KiB header). Today the tier reads each file whole, and the forward
starts when all are in: vLLM's own hit plus the reads. The design left for the 1.5x goal
(docs/benchmarks-log/ttft.md) reads every file's layer-0 range first, then layer 1, ..., so the
forward of layer i could run while later layers arrive. This measures, on real files with
O_DIRECT and the tier's 8 reader threads, side by side in one process:

  reads alone   whole files (62 reads) against layer ranges (496 reads; opened once per
                read, and once per file) and layer 0 first, then the rest of each file
                (124 reads): when the first layer is in, and when all are
  with a forward  a stand-in forward (`--layer-ms` of torch work per layer, on this
                process's cores, as vLLM CPU's forward of the hit's last tokens: ~3.3 ms
                per layer) that starts each layer when its bytes are in: its end, against
                reads-then-forward and the forward alone

The stand-in forward is a simulation (matrix products, not vLLM), so the absolute times are
not bench_ttft's; what it shows is whether the overlap can win on this machine's disk.

    python benchmarks/bench_layer_reads.py --json layer-reads.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HEADER = 4096


class Hit:
    """`files` block files of `layers` ranges of `layer_bytes`, and an aligned buffer each."""

    def __init__(self, root: Path, files: int, layers: int, layer_bytes: int,
                 threads: int) -> None:
        self.files, self.layers, self.layer_bytes = files, layers, layer_bytes
        self.paths = [str(root / f"block-{i}") for i in range(files)]
        for path in self.paths:
            with open(path, "wb") as f:
                f.write(os.urandom(HEADER + layers * layer_bytes))
        os.sync()  # (written back: the reads go to the device, not to dirty pages)
        self.buffers = [mmap.mmap(-1, layers * layer_bytes) for _ in range(files)]
        self.pool = ThreadPoolExecutor(threads)

    def _read(self, i: int, first: int, count: int) -> None:
        fd = os.open(self.paths[i], os.O_RDONLY | os.O_DIRECT)
        try:
            self._pread(fd, i, first, count)
        finally:
            os.close(fd)

    def _pread(self, fd: int, i: int, first: int, count: int) -> None:
        lo, n = first * self.layer_bytes, count * self.layer_bytes
        if os.preadv(fd, [memoryview(self.buffers[i])[lo:lo + n]], HEADER + lo) != n:
            raise OSError(f"short read of {self.paths[i]}")

    def read(self, way: str, on_layer=lambda layer: None) -> list[float]:
        """Read the hit; returns when each layer was complete (perf_counter)."""
        done: list[float] = []

        def layer_in(layer: int) -> None:
            done.append(time.perf_counter())
            on_layer(layer)

        if way == "whole":
            for f in [self.pool.submit(self._read, i, 0, self.layers) for i in range(self.files)]:
                f.result()
            for layer in range(self.layers):
                layer_in(layer)
        elif way == "first_then_rest":
            firsts = [self.pool.submit(self._read, i, 0, 1) for i in range(self.files)]
            rests = [self.pool.submit(self._read, i, 1, self.layers - 1)
                     for i in range(self.files)]
            for f in firsts:
                f.result()
            layer_in(0)
            for f in rests:
                f.result()
            for layer in range(1, self.layers):
                layer_in(layer)
        else:  # "by_layer" (an open per read) or "by_layer_open_once"
            fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in self.paths] \
                if way == "by_layer_open_once" else None
            try:
                futures = [[self.pool.submit(self._pread, fds[i], i, layer, 1) if fds else
                            self.pool.submit(self._read, i, layer, 1)
                            for i in range(self.files)] for layer in range(self.layers)]
                for layer, layer_futures in enumerate(futures):
                    for f in layer_futures:
                        f.result()
                    layer_in(layer)
            finally:
                for fd in fds or ():
                    os.close(fd)
        return done


def stand_in_layer(ms: float, a: torch.Tensor, b: torch.Tensor) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        torch.mm(a, b)


def with_forward(hit: Hit, way: str | None, layer_ms: float, a, b) -> float:
    """ms until the stand-in forward's last layer ends: None = no reads (the own hit);
    'sequential' = whole reads, then the forward; else layers start as they arrive."""
    start = time.perf_counter()
    if way is None:
        for _ in range(hit.layers):
            stand_in_layer(layer_ms, a, b)
    elif way == "sequential":
        hit.read("whole")
        for _ in range(hit.layers):
            stand_in_layer(layer_ms, a, b)
    else:
        arrived = [threading.Event() for _ in range(hit.layers)]
        reader = threading.Thread(target=hit.read, args=(way, lambda i: arrived[i].set()))
        reader.start()
        for layer in range(hit.layers):
            arrived[layer].wait()
            stand_in_layer(layer_ms, a, b)
        reader.join()
    return (time.perf_counter() - start) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="where to write the files (default: a "
                        "temporary directory, on the filesystem of $TMPDIR)")
    parser.add_argument("--files", type=int, default=62)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--layer-kib", type=int, default=32)
    parser.add_argument("--threads", type=int, default=8, help="the tier's io_threads")
    parser.add_argument("--layer-ms", type=float, default=3.3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ways = ["whole", "by_layer", "by_layer_open_once", "first_then_rest"]
    forwards = [None, "sequential", "by_layer_open_once", "first_then_rest"]
    a, b = torch.randn(16, 1024), torch.randn(1024, 1024)
    reads: dict[str, dict[str, list[float]]] = {w: {"first": [], "all": []} for w in ways}
    totals: dict[str, list[float]] = {str(w): [] for w in forwards}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        hit = Hit(Path(tmp), args.files, args.layers, args.layer_kib << 10, args.threads)
        for r in range(args.rounds + 1):  # (round 0: warm-up)
            for k in range(len(ways)):
                way = ways[(r + k) % len(ways)]
                time.sleep(0.05)
                start = time.perf_counter()
                done = hit.read(way)
                if r:
                    reads[way]["first"].append((done[0] - start) * 1e3)
                    reads[way]["all"].append((done[-1] - start) * 1e3)
            for k in range(len(forwards)):
                way = forwards[(r + k) % len(forwards)]
                time.sleep(0.05)
                took = with_forward(hit, way, args.layer_ms, a, b)
                if r:
                    totals[str(way)].append(took)
        hit.pool.shutdown()
    mib = args.files * args.layers * args.layer_kib / 1024
    print(f"{args.files} files x {args.layers} layers x {args.layer_kib} KiB ({mib:.1f} MiB), "
          f"O_DIRECT, {args.threads} threads; medians of {args.rounds} rounds; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'reads':20s} {'reads':>6s} {'first layer ms':>15s} {'all ms':>8s}")
    per_file = {"whole": 1, "by_layer": args.layers, "by_layer_open_once": args.layers,
                "first_then_rest": 2}
    for way in ways:
        print(f"{way:20s} {per_file[way] * args.files:6d} "
              f"{statistics.median(reads[way]['first']):15.1f} "
              f"{statistics.median(reads[way]['all']):8.1f}")
    print(f"stand-in forward of {args.layers} x {args.layer_ms} ms, ends at (ms):")
    names = {"None": "forward alone (own hit)", "sequential": "whole reads, then forward"}
    for way, values in totals.items():
        print(f"  {names.get(way, 'layers as they arrive: ' + way):45s} "
              f"{statistics.median(values):7.1f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "reads_ms": reads, "forward_ends_ms": totals},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
