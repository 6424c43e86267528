"""CPU executor: moves a CopyPlan with a handful of large torch operations.

For each segment (see geometry.py) the pairs are moved by the cheapest of four
strategies, chosen by a simple cost rule (calls x call overhead + bytes / rate):

- runs:    one `copy_` per run where block ids and slot ids both advance by one;
- gather:  one `index_select(out=...)` per stretch of consecutive destinations
           (a row-wise memcpy straight into the destination);
- scatter: one `index_copy_` per stretch of consecutive sources;
- staged:  both sides scattered: `index_select` a chunk into a small buffer
           that stays in cache, then `index_copy_` it to the destination.

No Python loop runs per page: loops are per run/stretch/chunk. torch spreads
each large operation over its intra-op threads (both cores here).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from kv_offload.kernels.plan import CopyPlan, Direction, GroupPlan, stretches

# Cost rule constants (microseconds, bytes per microsecond), measured on a 2-core
# EPYC with benchmarks/bench_cpu_backend.py; only their ratios matter.
CALL_US = 6.0  # one torch call from Python, with its slicing
ROW_US = 0.05  # per-row bookkeeping inside index_select / index_copy_
COPY_RATE = 8000.0  # copy_ / index_select rows
SCATTER_RATE = 5000.0  # index_copy_ (element-wise)
STAGE_BYTES = 1 << 20  # staging chunk: fits in L2


@dataclass(frozen=True)
class Choice:
    name: str
    cost_us: float


def choose(plan: GroupPlan, row_bytes: int,
           only: str | None = None) -> tuple[str, tuple[np.ndarray, ...]]:
    """The cheapest strategy for these pairs (or strategy `only`) and the arrays it needs."""
    n, total = plan.num_pairs, plan.num_pairs * row_bytes
    options = {"runs": (len(plan.runs) * CALL_US + total / COPY_RATE, ())}
    if len(plan.runs) > 1 or only:
        dst_starts, dst_lengths = stretches(plan.dst)
        options["gather"] = (len(dst_starts) * CALL_US + n * ROW_US + total / COPY_RATE,
                             (dst_starts, dst_lengths))
        by_src = np.argsort(plan.src, kind="stable")
        src_starts, src_lengths = stretches(plan.src[by_src])
        options["scatter"] = (len(src_starts) * CALL_US + n * ROW_US + total / SCATTER_RATE,
                              (by_src, src_starts, src_lengths))
        chunks = -(-total // STAGE_BYTES)
        options["staged"] = (2 * chunks * CALL_US + 2 * n * ROW_US + total / COPY_RATE
                             + total / (4 * SCATTER_RATE), ())
    if only is not None and only not in options:
        raise ValueError(f"unknown copy strategy {only!r}; expected one of {sorted(options)}")
    name = only or min(options, key=lambda k: options[k][0])
    return name, options[name][1]


class CpuCopier:
    """Executes CopyPlans between engine views and host views on the CPU.

    Thread-safe: concurrent calls (a store and a load) each get their own
    staging buffer."""

    def __init__(self, segments: list[list]) -> None:
        self._segments = segments
        self._local = threading.local()

    def copy(self, plan: CopyPlan, strategy: str | None = None) -> int:
        """Move every pair of `plan` (by `strategy`, default the cost rule's pick);
        returns the real bytes moved."""
        for group_plan in plan.groups:
            for segment in self._segments[group_plan.group]:
                if plan.direction is Direction.STORE:
                    src, dst = segment.engine, segment.host
                else:
                    src, dst = segment.host, segment.engine
                self.copy_rows(src, dst, group_plan, strategy)
        return plan.num_bytes

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor, plan: GroupPlan,
                  strategy: str | None = None) -> str:
        """dst[plan.dst[i]] = src[plan.src[i]] for every pair, by `strategy` (default:
        the cheapest by the cost rule); returns the strategy used."""
        row_bytes = src[0].numel() * src.element_size()
        name, extra = choose(plan, row_bytes, strategy)
        getattr(self, "_" + name)(src, dst, plan, *extra)
        return name

    @staticmethod
    def _runs(src: torch.Tensor, dst: torch.Tensor, plan: GroupPlan) -> None:
        for s, d, k in plan.runs.tolist():
            dst[d:d + k].copy_(src[s:s + k])

    @staticmethod
    def _gather(src: torch.Tensor, dst: torch.Tensor, plan: GroupPlan,
                starts: np.ndarray, lengths: np.ndarray) -> None:
        src_ids = torch.from_numpy(plan.src)
        for a, k in zip(starts.tolist(), lengths.tolist()):
            d = int(plan.dst[a])
            torch.index_select(src, 0, src_ids[a:a + k], out=dst[d:d + k])

    @staticmethod
    def _scatter(src: torch.Tensor, dst: torch.Tensor, plan: GroupPlan,
                 by_src: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        src_sorted = plan.src[by_src]
        dst_ids = torch.from_numpy(plan.dst[by_src])
        for a, k in zip(starts.tolist(), lengths.tolist()):
            s = int(src_sorted[a])
            dst.index_copy_(0, dst_ids[a:a + k], src[s:s + k])

    def _staged(self, src: torch.Tensor, dst: torch.Tensor, plan: GroupPlan) -> None:
        row_shape = src.shape[1:]
        rows = max(1, STAGE_BYTES // (src[0].numel() * src.element_size()))
        stage = self._stage(src.dtype, rows * src[0].numel()).view(rows, *row_shape)
        src_ids, dst_ids = torch.from_numpy(plan.src), torch.from_numpy(plan.dst)
        for a in range(0, plan.num_pairs, rows):
            part = stage[:min(rows, plan.num_pairs - a)]
            torch.index_select(src, 0, src_ids[a:a + rows], out=part)
            dst.index_copy_(0, dst_ids[a:a + rows], part)

    def _stage(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buffers = self._local.__dict__.setdefault("stage", {})
        buf = buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
        return buf[:numel]
