"""How long does a copy plan take to sort its row ids, compiled and with numpy?

Every job's plan orders its pairs by destination (`kernels/plan.py: argsort_ids`). Dense
ids without repeats (a job's own blocks or slots, the common case) are placed by numpy's
counting; the rest, ids spread over a much larger range or ids that repeat, went to
numpy's comparison sort, and now go to the compiled radix sort (`_host_rows.order_ids`)
where the install built it. This times both ways side by side, interleaved, in one
process:

  dense     n distinct ids below 2n (numpy's counting in both columns: the control)
  repeats   n ids below 2n, a tenth of them one repeated id
  sparse    n distinct ids below 32n (a job of a few blocks of a large cache)

    python benchmarks/bench_plan_sort.py --json plan-sort.json

Each figure is the median of `--repeats` calls; the ids are shuffled once per case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from kv_offload.kernels import plan as plan_kernels


def cases(n: int, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, int]]:
    repeats = rng.integers(0, 2 * n, n)
    repeats[::10] = repeats[1]
    return {"dense": (rng.permutation(2 * n)[:n], 2 * n),
            "repeats": (repeats, 2 * n),
            "sparse": (rng.permutation(32 * n)[:n], 32 * n)}


def median_ms(ids: np.ndarray, limit: int, module, repeats: int) -> float:
    saved, plan_kernels.HOST_ROWS = plan_kernels.HOST_ROWS, module
    try:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            plan_kernels.argsort_ids(ids, limit)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3
    finally:
        plan_kernels.HOST_ROWS = saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 16384, 131072])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    module = plan_kernels.HOST_ROWS
    if module is None:
        print("the compiled module is not built (install with a C compiler): numpy only")
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'case':8s} {'ids':>7s} {'numpy ms':>9s} {'compiled ms':>12s} {'ratio':>6s}")
    for n in args.sizes:
        for name, (ids, limit) in cases(n, rng).items():
            ids = ids.astype(np.int64)
            numpy_ms = compiled_ms = None
            for _ in range(3):  # (interleaved: both ways see the same moments of the machine)
                numpy_ms = median_ms(ids, limit, None, args.repeats)
                if module is not None:
                    compiled_ms = median_ms(ids, limit, module, args.repeats)
            ratio = numpy_ms / compiled_ms if compiled_ms else float("nan")
            print(f"{name:8s} {n:7d} {numpy_ms:9.3f} "
                  f"{compiled_ms if compiled_ms is not None else float('nan'):12.3f} "
                  f"{ratio:6.1f}")
            rows.append({"case": name, "ids": n, "limit": limit, "numpy_ms": numpy_ms,
                         "compiled_ms": compiled_ms})
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
