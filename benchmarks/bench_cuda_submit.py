"""Host-side cost of submitting GPU copy jobs, measured without a GPU.

What this measures: the time `CudaCopier.submit` spends in our own code (planning
runs, building 2D calls, batch descriptors and kernel descriptors) for example-model
jobs, with a runtime that counts the CUDA calls instead of making them. What it does
not measure: the CUDA calls themselves, nor the copies. To put the two side by side,
the table adds the enqueue cost the selection rule assumes for the calls issued
(a 2D call's host time as measured on an H200, `cuda_calls.MEMCPY_CALL_US`; a batched
copy's as measured there; a launch's published order of magnitude). The whole GPU
path, measured on a GPU: `benchmarks/bench_cuda_paths.py`.

    python benchmarks/bench_cuda_submit.py --json bench-cuda-submit.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from kv_offload import canonicalize
from kv_offload.kernels import BlockCopier, CudaRuntime, Direction, EngineReady
from kv_offload.kernels.cuda_calls import MEMCPY_CALL_US
from kv_offload.testing.example_models import build_example

KERNEL_LAUNCH_US = 5.0  # one kernel launch (published order of magnitude), for the model
BATCH_CALL_US = 5.0  # one cudaMemcpyBatchAsync call (published) ...
BATCH_COPY_US = 0.7  # ... plus this per copy: measured for stores on an H200 (loads: 1.7)


class CountingRuntime(CudaRuntime):
    """Accepts every call and counts it; moves nothing. Engine and pool are `meta`
    tensors, so only addresses exist: the models need no memory."""

    def __init__(self) -> None:
        self.counts = {"memcpy2d": 0, "batch": 0, "batch_copies": 0, "launch": 0}

    def current_stream(self):
        return 0

    def new_stream(self):
        return 1

    def new_event(self):
        return object()

    def record(self, event, stream) -> None:
        pass

    def stream_wait_event(self, stream, event) -> None:
        pass

    def query(self, event) -> bool:
        return True

    def synchronize(self, event) -> None:
        pass

    def memcpy2d_async(self, dst, dpitch, src, spitch, width, height, kind, stream) -> None:
        self.counts["memcpy2d"] += 1

    @property
    def batch_available(self) -> bool:
        return True

    def memcpy_batch_async(self, dsts, srcs, sizes, attrs, attrs_idxs, stream) -> None:
        self.counts["batch"] += 1
        self.counts["batch_copies"] += int(sizes.size)

    def compile_kernel(self, source, name):
        return name

    def launch(self, kernel, grid, block, args, stream) -> None:
        self.counts["launch"] += 1

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def check_host_pool(self, pool) -> None:
        pass


CASES = [  # (model, layout, blocks per job)
    ("llama-8b", "LBNHC", 16), ("llama-8b", "LBNHC", 256), ("llama-8b", "BLNHC", 256),
    ("gemma3", "LBNHC", 64), ("qwen3-next", "LBNHC", 16), ("deepseek-mla", "LBHNC", 64),
]


def measure(name: str, layout: str, blocks: int, repeats: int) -> list[dict]:
    num_blocks = 2 * blocks
    model = build_example(name, num_blocks, layout=layout, device="meta")
    canonical = canonicalize(model.kv_caches, model.groups, num_blocks)
    slot_bytes = max(canonical.slot_bytes_per_block(g) for g in range(len(model.groups)))
    pool = torch.empty(blocks, slot_bytes, dtype=torch.int8, device="meta")
    runtime = CountingRuntime()
    copier = BlockCopier(canonical, pool, runtime=runtime)
    rng = np.random.default_rng(0)
    rows = []
    for pattern in ("scattered", "runs"):
        ids = rng.permutation(num_blocks)[:blocks] if pattern == "scattered" else \
            np.arange(blocks)
        plan = copier.plan(Direction.STORE, {0: (ids, np.arange(blocks))})
        for path in ("dma", "batch", "kernel", None):
            runtime.counts = dict.fromkeys(runtime.counts, 0)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                job = copier.submit(plan, EngineReady(None), path)
                times.append(time.perf_counter() - start)
                assert job.done() and job.error is None, job.error
            counts = {k: v // repeats for k, v in runtime.counts.items()}
            model_us = (counts["memcpy2d"] * MEMCPY_CALL_US + counts["launch"] * KERNEL_LAUNCH_US
                        + counts["batch"] * BATCH_CALL_US + counts["batch_copies"] * BATCH_COPY_US)
            rows.append(dict(model=name, layout=layout, blocks=blocks, pattern=pattern,
                             path=path or "auto:" + ",".join(copier.last_strategies(
                                 Direction.STORE)),
                             ours_us=1e6 * float(np.median(times)), calls=counts,
                             modelled_cuda_us=model_us))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rows = [row for case in CASES for row in measure(*case, args.repeats)]
    print(f"{'model':13}{'layout':7}{'blocks':>7} {'pattern':10}{'path':18}{'ours us':>9}"
          f"{'2D':>6}{'batch':>7}{'copies':>8}{'launch':>7}{'+CUDA us (model)':>18}")
    for r in rows:
        c = r["calls"]
        print(f"{r['model']:13}{r['layout']:7}{r['blocks']:>7} {r['pattern']:10}{r['path']:18}"
              f"{r['ours_us']:>9.0f}{c['memcpy2d']:>6}{c['batch']:>7}{c['batch_copies']:>8}"
              f"{c['launch']:>7}{r['modelled_cuda_us']:>18.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "note": "ours_us measured on this host with no GPU; "
                       "modelled_cuda_us = per-call costs (measured on an H200; "
                       "a launch: published) x calls issued"}, f, indent=1)


if __name__ == "__main__":
    main()
