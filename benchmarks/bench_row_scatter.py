"""How fast can 2 KiB pages be scattered into random engine blocks on this machine?

Issue 23 asks loads of 2 KiB pages (`kv-offload bench --tier host --page-kib 2`) to reach
0.5x of a plain torch copy, or a profile showing why the machine cannot. This measures, side
by side in one process on the same buffers (an engine of 2N rows of 2 KiB, a pool of N rows;
the pool's rows go to a random half of the engine's rows, as that bench's load does):

  plain               one torch copy of the same bytes (the 1.0 every ratio is to)
  numpy_1 / numpy_2   numpy's fancy-index row assignment (`engine[ids] = pool`), the
                      primitive our CPU copier's "scatter" strategy runs, on 1 and 2 threads
  torch_index_copy    torch's `index_copy_` on 2 threads (its own intra-op threads)
  index_copy_i64_2 /  torch's `index_copy_` over the rows viewed as 8- or 16-byte elements
  index_copy_c128_2   (int64, complex128: 256 or 128 elements per row instead of 2048), on 2
                      threads of our own, each single-threaded torch
  index_copy_c128_t / torch's `index_copy_` and `index_put_` over the complex128 view, on
  index_put_c128_t    torch's own intra-op threads
  compiled_t          `torch.compile`'s `index_copy_` over the int64 view: the row scatter as
                      a C++ loop that TorchInductor generates and compiles here (a C++
                      compiler needed; skipped otherwise), on torch's own OpenMP threads;
                      compiled once before the timing (`compile_s`: how long that took)
  copier              our `CpuCopier` moving the same plan (its plan built beforehand), by
                      the strategy its cost rule picks: the compiled row loop ("rows",
                      kernels/_host_rows.c) where the install built it
  copier_numpy        the same, forced to numpy's "scatter" (what it ran before that loop)
  job                 a whole load job through `HostTier` (planning included)
  job_numpy           the same without the compiled module (numpy and torch strategies,
                      numpy's sort for planning)
  plan_ms /           milliseconds (not a ratio) to plan that load job: check the pairs,
  plan_numpy_ms       sort them by engine block and map slots to pool rows; these ids are
                      dense, so numpy's counting sorts them either way, and the compiled
                      sort (`order_ids`, for sparse or repeated ids) is not reached
  c_1 / c_2           a memcpy per row in C on 1 and 2 pthreads (compiled here with `cc`
                      if there is one; skipped otherwise): what the memory system allows
                      without an interpreter in the way
  numpy_2_huge        numpy_2 again, engine and pool copied into memory on 2 MiB pages
                      (transparent huge pages, `madvise`), its ratio to a plain copy between
                      those same buffers: what the scatter loses to address translation
                      (a random 2 KiB row is a TLB miss on 4 KiB pages); skipped where the
                      kernel gives no huge pages (`huge_mib`: how many it gave)

    python benchmarks/bench_row_scatter.py --json row-scatter.json

Each figure is the best of `--repeats`, the whole run repeated `--runs` times; the table has
the median over runs of each ratio.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

PAGE = 2048
C_PROBE = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static char *eng, *pool; static long *ids; static long n;
typedef struct { long lo, hi; } share_t;
static void *work(void *p) { share_t *s = p;
  for (long i = s->lo; i < s->hi; i++) memcpy(eng + ids[i] * PAGE, pool + i * PAGE, PAGE);
  return 0; }
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
  n = atol(argv[1]); int threads = atoi(argv[2]), repeats = atoi(argv[3]);
  eng = aligned_alloc(4096, 2 * n * PAGE); pool = aligned_alloc(4096, n * PAGE);
  memset(eng, 1, 2 * n * PAGE); memset(pool, 2, n * PAGE);
  ids = malloc(n * sizeof(long)); FILE *f = fopen(argv[4], "rb");
  if (fread(ids, sizeof(long), n, f) != (size_t)n) return 1;
  double best = 1e9, plain = 1e9;
  for (int r = 0; r < repeats; r++) {
    double t0 = now(); memcpy(eng, pool, n * PAGE); double t = now() - t0;
    if (t < plain) plain = t;
    pthread_t th[16]; share_t s[16]; t0 = now();
    for (int k = 0; k < threads; k++) { s[k].lo = n * k / threads; s[k].hi = n * (k + 1) / threads;
      pthread_create(&th[k], 0, work, &s[k]); }
    for (int k = 0; k < threads; k++) pthread_join(th[k], 0);
    t = now() - t0; if (t < best) best = t; }
  printf("%f %f\n", plain, best); return 0; }
"""


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        time.sleep(0.05)  # (torch's OpenMP threads stop spinning)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def on_threads(fn, parts: int, n: int):
    def run() -> None:
        bounds = [n * k // parts for k in range(parts + 1)]
        threads = [threading.Thread(target=fn, args=(a, b)) for a, b in zip(bounds, bounds[1:])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return run


def anon_huge_kib() -> int:
    """This process's anonymous memory on huge pages, KiB (0 where the kernel cannot say)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next((int(line.split()[1]) for line in f
                         if line.startswith("AnonHugePages:")), 0)
    except OSError:
        return 0


def huge_page_copy(array: np.ndarray) -> tuple[mmap.mmap, np.ndarray] | None:
    """`array` copied into private anonymous memory advised onto 2 MiB pages (None: no
    MADV_HUGEPAGE here). Keep the mmap alive while the view is used."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return None
    region = mmap.mmap(-1, array.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(advice)  # (before the first touch: the pages fault in huge)
    view = np.frombuffer(region, dtype=array.dtype).reshape(array.shape)
    view[...] = array
    return region, view


def huge_page_scatter(engine_np: np.ndarray, pool_np: np.ndarray, ids: np.ndarray,
                      repeats: int) -> dict[str, float]:
    """numpy_2 between copies of the buffers on 2 MiB pages, as a ratio to a plain copy
    between those copies; {} where the kernel gave no huge pages."""
    before = anon_huge_kib()
    engine_copy, pool_copy = huge_page_copy(engine_np), huge_page_copy(pool_np)
    if engine_copy is None or pool_copy is None:
        return {}
    gained_mib = (anon_huge_kib() - before) / 1024
    if gained_mib <= 0:
        return {}
    engine_huge, pool_huge = engine_copy[1], pool_copy[1]
    n = pool_huge.shape[0]

    def part(a: int, b: int) -> None:
        engine_huge[ids[a:b]] = pool_huge[a:b]

    plain = best_of(lambda: torch.from_numpy(engine_huge[:n]).copy_(torch.from_numpy(pool_huge)),
                    repeats)
    scatter = best_of(on_threads(part, 2, n), repeats)
    return {"numpy_2_huge": plain / scatter, "huge_mib": gained_mib}


def c_probe(ids: np.ndarray, threads: int, repeats: int) -> float | None:
    """The C memcpy loop's time / a C memcpy of the same bytes (None: no compiler)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe, id_file = Path(tmp, "probe.c"), Path(tmp, "probe"), Path(tmp, "ids")
        src.write_text(C_PROBE.replace("PAGE", str(PAGE)))
        subprocess.run([cc, "-O2", "-o", str(exe), str(src), "-lpthread"], check=True)
        ids.astype(np.int64).tofile(id_file)
        out = subprocess.run([str(exe), str(ids.size), str(threads), str(repeats), str(id_file)],
                             check=True, capture_output=True, text=True).stdout.split()
    plain, scatter = map(float, out)
    return plain / scatter


_compiled: list = []  # torch.compile's index_copy_, built once per process


def compiled_index_copy():
    """`dst.index_copy_(0, ids, src)` through TorchInductor (dynamic shapes: one build for
    every row count), built at its first call, which raises where it cannot build (e.g. no
    C++ compiler)."""
    if not _compiled:
        def index_copy(dst: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
            dst.index_copy_(0, ids, src)

        _compiled.append(torch.compile(index_copy, dynamic=True))
    return _compiled[0]


def compiled_scatter(engine: torch.Tensor, pool: torch.Tensor, ids: torch.Tensor,
                     repeats: int) -> dict[str, float]:
    """The compiled scatter's time and its build's, {} where it cannot build."""
    wide_engine, wide_pool = engine.view(torch.int64), pool.view(torch.int64)
    engine.numpy()[ids.numpy()] = 0  # (the earlier ways put the pool's rows there already)
    fn = compiled_index_copy()
    start = time.perf_counter()
    try:
        fn(wide_engine, ids[:8], wide_pool[:8])
    except Exception as exc:  # (inductor's errors name a missing compiler, among others)
        print(f"compiled_t skipped: torch.compile failed: {type(exc).__name__}: {exc}")
        return {}
    built_s = time.perf_counter() - start
    timed = best_of(lambda: fn(wide_engine, ids, wide_pool), repeats)
    assert np.array_equal(engine.numpy()[ids.numpy()], pool.numpy())  # (it did scatter)
    return {"compiled_t": timed, "compile_s": built_s}


def one_run(n: int, repeats: int, seed: int) -> dict[str, float]:
    from kv_offload.canonical import canonicalize
    from kv_offload.kernels import cpu as cpu_kernels
    from kv_offload.kernels import plan as plan_kernels
    from kv_offload.store.host import HostTier
    from kv_offload.tools.bench_cpu import fill_pattern, synthetic_model
    from kv_offload.transfer import Direction

    model = synthetic_model(PAGE // 1024, 1, 2 * n, "LBNHC")
    canonical = canonicalize(model.kv_caches, model.groups, model.num_blocks)
    backend = HostTier(canonical, n * PAGE)
    try:
        fill_pattern(model.buffer)
        backend.pool.fill_(3)
        ids = np.random.default_rng(seed).permutation(2 * n)[:n]
        engine = model.buffer.view(2 * n, PAGE)
        pool = backend.pool.view(-1)[:n * PAGE].view(n, PAGE)
        engine_np, pool_np = engine.numpy(), pool.numpy()
        loads = {0: (ids, np.arange(n))}
        plan = backend.copier.plan(Direction("load"), loads)
        copier = backend.copier._cpu  # (the executor itself, its plan built above)

        def numpy_part(a: int, b: int) -> None:
            engine_np[ids[a:b]] = pool_np[a:b]

        def wide_part(dtype):
            wide_engine, wide_pool = engine.view(dtype), pool.view(dtype)

            def part(a: int, b: int) -> None:
                torch.set_num_threads(1)  # (this thread only: as our copy threads run)
                wide_engine.index_copy_(0, ids_t[a:b], wide_pool[a:b])
            return part

        def job() -> None:
            (result,) = backend.wait([backend.submit_load(loads)])
            assert result.success

        def without_module(fn):  # (the copier's cost rule and the planning sort)
            def run() -> None:
                module = cpu_kernels.HOST_ROWS
                cpu_kernels.HOST_ROWS = plan_kernels.HOST_ROWS = None
                try:
                    fn()
                finally:
                    cpu_kernels.HOST_ROWS = plan_kernels.HOST_ROWS = module
            return run

        def planning() -> None:
            backend.slot_map.physical(backend.copier.plan(Direction("load"), loads),
                                      model.num_blocks)

        ids_t = torch.from_numpy(ids)
        wide_engine, wide_pool = engine.view(torch.complex128), pool.view(torch.complex128)
        plain = best_of(lambda: engine.view(-1)[:n * PAGE].copy_(pool.view(-1)), repeats)
        figures = {
            "numpy_1": best_of(lambda: numpy_part(0, n), repeats),
            "numpy_2": best_of(on_threads(numpy_part, 2, n), repeats),
            "torch_index_copy": best_of(lambda: engine.index_copy_(0, ids_t, pool), repeats),
            "index_copy_i64_2": best_of(on_threads(wide_part(torch.int64), 2, n), repeats),
            "index_copy_c128_2": best_of(on_threads(wide_part(torch.complex128), 2, n), repeats),
            "index_copy_c128_t": best_of(lambda: wide_engine.index_copy_(0, ids_t, wide_pool),
                                         repeats),
            "index_put_c128_t": best_of(lambda: wide_engine.index_put_((ids_t,), wide_pool),
                                        repeats),
            "copier": best_of(lambda: copier.copy(plan), repeats),
            "copier_numpy": best_of(lambda: copier.copy(plan, "scatter"), repeats),
            "job": best_of(job, repeats),
            "job_numpy": best_of(without_module(job), repeats),
        }
        milliseconds = {"plan_ms": best_of(planning, repeats) * 1e3,
                        "plan_numpy_ms": best_of(without_module(planning), repeats) * 1e3}
        compiled = compiled_scatter(engine, pool, ids_t, repeats)
        if compiled:
            figures["compiled_t"] = compiled["compiled_t"]
        ratios = {name: plain / t for name, t in figures.items()}
        if compiled:
            ratios["compile_s"] = compiled["compile_s"]
        ratios.update(milliseconds)
        ratios["plain_gbps"] = n * PAGE / plain / 1e9
        ratios.update(huge_page_scatter(engine_np, pool_np, ids, repeats))
        for threads in (1, 2):
            ratio = c_probe(ids, threads, repeats)
            if ratio is not None:
                ratios[f"c_{threads}"] = ratio
        return ratios
    finally:
        backend.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=131072, help="pool rows (256 MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    runs = [one_run(args.rows, args.repeats, seed) for seed in range(args.runs)]
    names = list(runs[0])
    print(f"2 KiB rows scattered into a random half of {2 * args.rows} engine rows; "
          f"ratio to a plain copy of the same bytes; median of {args.runs} runs "
          f"(each the best of {args.repeats}); load average {os.getloadavg()[0]:.1f}")
    print(f"{'':18s} {'median':>7s}  runs")
    for name in names:
        values = [run[name] for run in runs if name in run]
        print(f"{name:18s} {statistics.median(values):7.2f}  "
              + " ".join(f"{v:.2f}" for v in values))
    if args.json:
        args.json.write_text(json.dumps({"rows": args.rows, "page": PAGE, "runs": runs},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
