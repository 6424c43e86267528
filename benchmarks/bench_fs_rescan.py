"""How long an engine-side `lookup` waits while the filesystem tier merges a rescan.

The tier's index (`KeyIndex`) is filled with N keys (a start-up merge), then one rescan is
merged: a synthetic listing in which 1% of the keys vanished (another process deleted them),
1% are new (another process wrote them) and the rest are unchanged, followed by
`evict_to_budget` with a budget 1% below what the listing holds. Meanwhile a probe thread plays
the engine: every ~200 µs it calls `contains([key])` (what `FilesystemTier.lookup` does) and
records how late the call returns, counted from the moment its sleep should have ended: the
wait for the interpreter lock (GIL) that the merging thread holds between its pauses, the wait
for the index lock, and the call itself (idle: timer slack of the sleep plus ~3 µs).

Rows:
- `merge`: probes during the merge, for this tree's `KeyIndex` and, with `--baseline-rev`, for
  the `KeyIndex` of another git revision (`index.py` loaded from `git show REV:...`), measured
  side by side in the same run. "lock held" is the longest single hold of the index lock by the
  merging thread (the probe's own short holds excluded).
- `idle`: the same probe with nothing else running: the floor of a `contains` call.
- `busy python`: the probe while another thread runs a plain Python loop for 0.5 s: what any
  busy Python thread costs a caller (the GIL is handed over every `sys.getswitchinterval()`).

    python benchmarks/bench_fs_rescan.py --baseline-rev 8469887 --json bench_fs_rescan.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from kv_offload.backends.common import index as current_index

FILE_BYTES = 2 * 1024 * 1024 + 4096  # a 2 MiB page file and its header
PROBE_SLEEP_S = 0.0002


class TimedLock:
    """A drop-in for the index's `threading.Lock` that records how long one thread holds it:
    wall time (what a waiter sees) and the thread's CPU time (the work done under the lock;
    the difference is time the OS ran other threads while this one held the lock)."""

    def __init__(self, watched: threading.Thread) -> None:
        self._lock = threading.Lock()
        self._watched = watched
        self._since = self._cpu_since = 0.0
        self.holds: list[float] = []
        self.cpu_holds: list[float] = []

    def acquire(self, *args) -> bool:
        got = self._lock.acquire(*args)
        if got and threading.current_thread() is self._watched:
            self._since, self._cpu_since = time.perf_counter(), time.thread_time()
        return got

    def release(self) -> None:
        if threading.current_thread() is self._watched:
            self.holds.append(time.perf_counter() - self._since)
            self.cpu_holds.append(time.thread_time() - self._cpu_since)
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


def load_baseline(rev: str):
    """The `index` module of git revision ``rev``, imported under another name."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # (the index moved to backends/common/ in issue 44's layout; older revisions hold it in
    # backends/filesystem/)
    for where in ("kv_offload/backends/common/index.py", "kv_offload/backends/filesystem/index.py"):
        shown = subprocess.run(["git", "-C", root, "show", f"{rev}:{where}"],
                               capture_output=True, text=True)
        if shown.returncode == 0:
            break
    shown.check_returncode()
    source = shown.stdout
    path = os.path.join(tempfile.mkdtemp(), "baseline_index.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("baseline_index", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_index"] = module
    spec.loader.exec_module(module)
    return module


def probe_while(work, index, key: bytes) -> tuple[list[float], float]:
    """Run ``work()`` in this thread while a probe thread calls ``index.contains([key])``;
    return the probe's call times during ``work`` (s) and how long ``work`` took."""
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            due = time.perf_counter() + PROBE_SLEEP_S
            time.sleep(PROBE_SLEEP_S)  # releases the GIL; getting it back is part of the wait
            index.contains([key])
            samples.append((due, time.perf_counter() - due))

    thread = threading.Thread(target=probe)
    thread.start()
    time.sleep(0.05)
    start = time.perf_counter()
    work()
    end = time.perf_counter()
    stop.set()
    thread.join()
    return [dt for t0, dt in samples if start <= t0 <= end], end - start


def summary(label: str, impl: str, keys: int, calls: list[float], seconds: float,
            lock: TimedLock | None = None) -> dict:
    calls_ms = sorted(1e3 * c for c in calls) or [float("nan")]
    holds = lock.holds if lock else []
    cpu_holds = sorted(lock.cpu_holds) if lock else []
    return {
        "case": label,
        "index": impl,
        "keys": keys,
        "seconds": seconds,
        "probes": len(calls),
        "p50_ms": statistics.median(calls_ms),
        "p99_ms": calls_ms[min(len(calls_ms) - 1, int(0.99 * len(calls_ms)))],
        "max_ms": calls_ms[-1],
        "longest_lock_hold_ms": 1e3 * max(holds) if holds else None,
        "lock_hold_cpu_p99_ms": 1e3 * cpu_holds[int(0.99 * len(cpu_holds))] if holds else None,
        "longest_lock_hold_cpu_ms": 1e3 * cpu_holds[-1] if holds else None,
        "lock_holds": len(holds) if holds else None,
    }


def scanned(module, keys: list[bytes], rng: random.Random):
    """A synthetic listing in the form the module's merge takes (columns, or one record per
    file for the old index)."""
    files = [module.ScannedFile(k, FILE_BYTES, rng.uniform(0, 1e6)) for k in keys]
    listing = getattr(module, "ScanListing", None)
    return files if listing is None else listing.of(files)


def bench_merge(module, impl: str, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    keys = [rng.randbytes(16) for _ in range(n)]
    churn = n // 100
    listing_keys = keys[churn:] + [rng.randbytes(16) for _ in range(churn)]
    index = module.KeyIndex(1 << 62)
    kwargs = {"pause": None} if "pause" in inspect.signature(index.merge_scan).parameters else {}
    index.merge_scan(scanned(module, keys, rng), index.start_scan(), **kwargs)
    listing = scanned(module, listing_keys, rng)
    index.budget_bytes = FILE_BYTES * (len(listing_keys) - churn)
    index._lock = TimedLock(threading.current_thread())  # same lock semantics, timed holds
    # A real scan's allocations run young collections while it lists: by the time the merge
    # starts, its listing has aged out of the young generations. Age this one the same way.
    gc.collect()

    def rescan() -> None:
        index.merge_scan(listing, index.start_scan())
        index.evict_to_budget()

    calls, seconds = probe_while(rescan, index, keys[-1])
    assert len(index) == len(listing_keys) - churn, "the merge did not apply the listing"
    return summary("merge", impl, n, calls, seconds, index._lock)


def bench_floor(n: int) -> list[dict]:
    index = current_index.KeyIndex(1 << 62)
    idle, idle_s = probe_while(lambda: time.sleep(0.5), index, b"k")

    def busy() -> None:
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            sum(i * i for i in range(100))

    loaded, loaded_s = probe_while(busy, index, b"k")
    return [summary("idle", "-", 0, idle, idle_s), summary("busy python", "-", 0, loaded, loaded_s)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", default="500000,1000000", help="index sizes, comma-separated")
    parser.add_argument("--baseline-rev", help="also measure the KeyIndex of this git revision")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--rounds", type=int, default=1, help="merges measured per size")
    args = parser.parse_args(argv)
    impls = [("this tree", current_index)]
    if args.baseline_rev:
        impls.insert(0, (f"rev {args.baseline_rev}", load_baseline(args.baseline_rev)))
    results = bench_floor(0)
    for n in (int(k) for k in args.keys.split(",")):
        for impl, module in impls:
            for round_ in range(args.rounds):
                results.append(bench_merge(module, impl, n, seed=n + round_))
    print(f"{'case':12}{'index':16}{'keys':>9}{'merge s':>8}{'probes':>7}{'p50 ms':>8}"
          f"{'p99 ms':>9}{'max ms':>9}{'held max':>9}{'cpu p99':>8}{'cpu max':>8}")

    def ms(value: float | None, width: int) -> str:
        return f"{'-' if value is None else f'{value:.3f}':>{width}}"

    for r in results:
        print(f"{r['case']:12}{r['index']:16}{r['keys']:9d}{r['seconds']:8.2f}{r['probes']:7d}"
              f"{r['p50_ms']:8.3f}{r['p99_ms']:9.3f}{r['max_ms']:9.3f}"
              f"{ms(r['longest_lock_hold_ms'], 9)}{ms(r['lock_hold_cpu_p99_ms'], 8)}"
              f"{ms(r['longest_lock_hold_cpu_ms'], 8)}")
    print("p50/p99/max: how late a probe's contains([key]) returned; merge s: merge and "
          "evict_to_budget; held max: longest lock hold by the merging thread (wall), cpu "
          "p99/max: its CPU time per hold (the work under the lock). "
          f"GIL switch interval {sys.getswitchinterval() * 1e3:.0f} ms; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": platform.python_version(), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
