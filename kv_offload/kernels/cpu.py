"""CPU executor: moves a CopyPlan with a handful of large row-copy operations.

For each segment (see geometry.py) the pairs become a few *ops*, by the
cheapest of five strategies under a simple cost rule (calls x call overhead +
rows x row overhead + bytes / rate):

- runs:    one `copy_` per run where block ids and slot ids both advance by one;
- rows:    one call of the compiled row loop (`_host_rows.c`) for every pair, in
           the plan's order (by destination); past the last-level cache it writes
           with non-temporal stores, as one large memcpy does (the reason the numpy
           and torch strategies below reach about half a plain copy's rate on 2 KiB
           pages).
           Offered where the package was built with a C compiler (`HOST_ROWS`)
           and each block's part of a segment is contiguous bytes;
- gather:  one `index_select(out=...)` per stretch of consecutive destinations
           (a row-wise memcpy straight into the destination);
- scatter: one numpy `dst[ids] = src[run]` per stretch of consecutive sources;
- staged:  both sides scattered: `index_select` a chunk into a buffer that
           stays in cache, then scatter it.

No Python loop runs per page: loops are per run, stretch or chunk. The ops are
cut into equal shares for a small pool of threads (one per core, at most
`MAX_THREADS`), each running its kernels single-threaded: torch's own
intra-op threads would open a parallel region per row copy, and each region
stalls whenever another process holds a core.

A copy is bounded: a caller that stops waiting for it (`timeout_s`, or its own
`cancelled` event) cancels the shares not started, and a running share stops
before its next op. Only the op in progress when that happens still runs; a
`CopyOverrun` hands the caller the `CopyRun` to watch until it has ended, so
nothing that copy reads or writes is reused before its last byte moved.
"""

from __future__ import annotations

import contextlib
import glob
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import numpy as np
import torch

from kv_offload.kernels.geometry import Segment
from kv_offload.kernels.plan import (  # (HOST_ROWS: the compiled module, or None)
    HOST_ROWS,
    CopyPlan,
    Direction,
    GroupPlan,
    argsort_ids,
    stretches,
)
from kv_offload.runtime.affinity import join_our_cpus

# Cost rule, single-threaded: microseconds per call and per row, bytes per microsecond,
# from timing each strategy on each access pattern (2-core EPYC); only ratios matter.
CALL_US = 4.0
ROW_US = 0.15
COPY_RATE = 12000.0  # copy_, index_select and numpy scatter rows
STAGED_RATE = 6000.0  # both passes of the staged copy
LOOP_ROW_US = 0.02  # the compiled loop's cost per row (no Python, no temporaries)
STAGE_BYTES = 1 << 20  # staging chunk: stays in L2
MAX_THREADS = 4
SPLIT_BYTES = 1 << 20  # smaller jobs run on one thread


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache of cpu0 (Linux sysfs), else `default`."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with contextlib.suppress(OSError, ValueError), open(path) as f:
            text = f.read().strip()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
    return max(sizes, default=default)


# Jobs this large write with non-temporal stores (the rows strategy): their bytes would not
# stay cached anyway, and not reading each destination line first is the gain glibc's memcpy
# has past its own threshold. Smaller ones stay in cache for the forward that reads them.
STREAM_BYTES = last_level_cache_bytes()


@dataclass(frozen=True, eq=False)
class Op:
    """Rows `count` of one strategy: `src`/`dst` are a start row (int) or row ids."""

    kind: str
    src_view: torch.Tensor
    dst_view: torch.Tensor
    src: int | np.ndarray
    dst: int | np.ndarray
    count: int
    streaming: bool = False  # rows: write with non-temporal stores

    def part(self, a: int, b: int) -> Op:
        def cut(ids: int | np.ndarray) -> int | np.ndarray:
            return ids + a if isinstance(ids, int) else ids[a:b]

        return Op(self.kind, self.src_view, self.dst_view, cut(self.src), cut(self.dst), b - a,
                  self.streaming)


def choose(plan: GroupPlan, row_bytes: int, src_rows: int,
           only: str | None = None, loop: bool = False) -> tuple[str, list]:
    """The cheapest strategy for these pairs (or strategy `only`) and its row
    groups: (src, dst, count) with an int start or an id array on each side.
    `src_rows` bounds the source ids; `loop`: the compiled row loop is offered."""
    n, total = plan.num_pairs, plan.num_pairs * row_bytes
    ideal = total / COPY_RATE  # moving the bytes, with no overhead at all
    costs = {"runs": _count_runs(plan) * CALL_US + ideal}
    by_src = None
    if loop:  # (one call for every pair: whenever offered, cheaper than the three below)
        costs["rows"] = CALL_US + n * LOOP_ROW_US + ideal
    if only not in (None, "runs", "rows") or (
            only is None and not loop and costs["runs"] > 1.05 * ideal):
        rows = n * ROW_US + ideal
        costs["gather"] = _count_stretches(plan.dst) * CALL_US + rows
        if only or costs["gather"] > 1.05 * rows:  # else the destination is one stretch
            by_src = argsort_ids(plan.src, src_rows)
            src_sorted = plan.src if by_src is None else plan.src[by_src]
            costs["scatter"] = _count_stretches(src_sorted) * CALL_US + rows
            chunks = -(-total // STAGE_BYTES)
            costs["staged"] = 2 * chunks * CALL_US + 2 * n * ROW_US + total / STAGED_RATE
    if only is not None and only not in costs:
        raise ValueError(f"unknown copy strategy {only!r}; expected one of {sorted(costs)}")
    name = only or min(costs, key=costs.__getitem__)
    return name, _row_groups(name, plan, by_src)


def _count_runs(plan: GroupPlan) -> int:
    """len(plan.runs), without building them (3 ms for 128k scattered pairs, mostly
    wasted when another strategy wins)."""
    if not plan.num_pairs:
        return 0
    return 1 + int(np.count_nonzero((np.diff(plan.src) != 1) | (np.diff(plan.dst) != 1)))


def _count_stretches(ids: np.ndarray) -> int:
    return 1 + int(np.count_nonzero(np.diff(ids) != 1)) if ids.size else 0


def _row_groups(name: str, plan: GroupPlan, by_src: np.ndarray | None) -> list:
    if name == "runs":
        return [(s, d, k) for s, d, k in plan.runs.tolist()]
    if name in ("rows", "staged"):  # (rows: the loop fetches scattered sources ahead)
        return [(plan.src, plan.dst, plan.num_pairs)]
    if name == "gather":
        starts, lengths = stretches(plan.dst)
        return [(plan.src[a:a + k], int(plan.dst[a]), k)
                for a, k in zip(starts.tolist(), lengths.tolist())]
    src, dst = (plan.src, plan.dst) if by_src is None else (plan.src[by_src], plan.dst[by_src])
    starts, lengths = stretches(src)
    return [(int(src[a]), dst[a:a + k], k) for a, k in zip(starts.tolist(), lengths.tolist())]


class CpuCopier:
    """Executes CopyPlans between engine views and host views on the CPU.

    Thread-safe: a store and a load may run at once, each on its own pool."""

    def __init__(self, segments: list[list[Segment]], threads: int | None = None,
                 split_bytes: int = SPLIT_BYTES, stream_bytes: int = STREAM_BYTES) -> None:
        self._segments = segments
        self.threads = threads or max(1, min(MAX_THREADS, os.cpu_count() or 1,
                                             torch.get_num_threads()))
        self.split_bytes = split_bytes
        self.stream_bytes = stream_bytes  # jobs this large: non-temporal stores (rows)
        self._pools: dict[Direction, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self.last_strategies: dict[Direction, tuple[str, ...]] = {}  # for benchmarks

    def copy(self, plan: CopyPlan, strategy: str | None = None,
             timeout_s: float | None = None, cancelled: threading.Event | None = None) -> int:
        """Move every pair of `plan` (by `strategy`, default the cost rule's pick);
        returns the real bytes moved. `timeout_s`: past it the copy is cancelled and
        `CopyOverrun` raised (a stuck thread). `cancelled`: the caller's own stop signal
        (set: no further op starts; the copy then fails)."""
        run = self.start(plan, strategy, cancelled)
        if not run.wait(timeout_s):
            run.cancel(f"the copy threads did not finish within {timeout_s} s")
            raise CopyOverrun(run)
        if run.error is not None:
            raise run.error
        return plan.num_bytes

    def start(self, plan: CopyPlan, strategy: str | None = None,
              cancelled: threading.Event | None = None) -> CopyRun:
        """Hand `plan`'s shares to the copy threads and return at once (see `copy`)."""
        ops = []
        streaming = plan.num_bytes >= self.stream_bytes
        for group_plan in plan.groups:
            for segment in self._segments[group_plan.group]:
                src, dst = ((segment.engine, segment.host) if plan.direction is Direction.STORE
                            else (segment.host, segment.engine))
                loop = HOST_ROWS is not None and _loop_fits(src) and _loop_fits(dst)
                name, groups = choose(group_plan, segment.block_bytes, src.shape[0], strategy,
                                      loop)
                ops += [Op(name, src, dst, s, d, k, streaming) for s, d, k in groups]
        self.last_strategies[plan.direction] = tuple(sorted({op.kind for op in ops}))
        shares = _shares(ops, self.threads if plan.num_bytes >= self.split_bytes else 1)
        pool = self._pool(plan.direction)
        cancelled = cancelled or threading.Event()
        return CopyRun([pool.submit(_run_ops, share, cancelled) for share in shares], cancelled)

    def close(self) -> None:
        with self._lock:
            pools, self._pools = self._pools, {}
        for pool in pools.values():  # (no wait: a stuck thread must not hold the caller)
            pool.shutdown(wait=False, cancel_futures=True)

    def _pool(self, direction: Direction) -> ThreadPoolExecutor:
        with self._lock:
            if direction not in self._pools:
                self._pools[direction] = ThreadPoolExecutor(
                    self.threads, f"kv-offload-copy-{direction.value}",
                    initializer=_copy_thread)
            return self._pools[direction]


class CopyRun:
    """One copy's shares on the copy threads: `done()`, `wait()`, `error`, `cancel()`."""

    def __init__(self, futures: list[Future], cancelled: threading.Event) -> None:
        self._futures = futures
        self._cancelled = cancelled
        self._stopped: str | None = None  # why the copy was cancelled

    def done(self) -> bool:
        """Whether every share has ended: nothing of this copy touches memory any more."""
        return all(future.done() for future in self._futures)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for every share to end, at most `timeout_s`; whether they all did."""
        return not wait_futures(self._futures, timeout_s).not_done

    def when_done(self, callback) -> None:
        """Call `callback()` once every share has ended (now, if they have), on the thread
        that ends the last one."""
        left = [len(self._futures)]
        lock = threading.Lock()

        def one_ended(_future: Future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                callback()

        if not self._futures:
            callback()
        for future in self._futures:
            future.add_done_callback(one_ended)

    def cancel(self, why: str) -> None:
        """Stop the copy: shares not started never start, a running one stops before
        its next op. The copy fails (`error`) even if every op had already run."""
        self._stopped = why
        self._cancelled.set()
        for future in self._futures:
            future.cancel()

    @property
    def error(self) -> Exception | None:
        """Why the copy failed (None: every op ran); meaningful once `done()`."""
        if self._stopped is not None or self._cancelled.is_set():
            return TimeoutError(self._stopped or "the copy was cancelled by its caller")
        for future in self._futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                return future.exception()
        return None


class CopyOverrun(TimeoutError):
    """A copy outlived its bound and was cancelled; `run` ends when its last running op
    does (until then its source and destination must not be reused)."""

    def __init__(self, run: CopyRun) -> None:
        super().__init__(str(run.error))
        self.run = run


def _shares(ops: list[Op], parts: int) -> list[list[Op]]:
    """Cut the ops into `parts` shares of equal bytes, splitting an op at a row
    boundary where a share ends."""
    if parts <= 1:
        return [ops] if ops else []
    row_weight = [op.src_view[0].numel() for op in ops]
    total = sum(op.count * w for op, w in zip(ops, row_weight))
    shares: list[list[Op]] = [[] for _ in range(parts)]
    done = 0
    for op, weight in zip(ops, row_weight):
        start = 0
        while start < op.count:
            index = min(parts - 1, done * parts // total)
            end_of_share = -(-total * (index + 1) // parts)
            rows = op.count - start
            if index < parts - 1:
                rows = min(rows, max(1, -(-(end_of_share - done) // weight)))
            shares[index].append(op.part(start, start + rows))
            start += rows
            done += rows * weight
    return [share for share in shares if share]


_stage = threading.local()


def _run_ops(ops: list[Op], cancelled: threading.Event) -> None:
    for op in ops:
        if cancelled.is_set():  # (the caller stopped waiting: no op starts after that)
            return
        src, dst = op.src_view, op.dst_view
        if op.kind == "runs":
            dst[op.dst:op.dst + op.count].copy_(src[op.src:op.src + op.count])
        elif op.kind == "rows":
            _loop_rows(op)
        elif op.kind == "gather":
            torch.index_select(src, 0, torch.from_numpy(op.src),
                               out=dst[op.dst:op.dst + op.count])
        elif op.kind == "scatter":
            dst.numpy()[op.dst] = src[op.src:op.src + op.count].numpy()
        else:
            _staged(src, dst, op.src, op.dst)


def _loop_fits(view: torch.Tensor) -> bool:
    """Whether the compiled loop can move `view`'s rows: (rows, parts, bytes) with each
    part contiguous (a segment's engine and host views always are, in every layout)."""
    return view.dim() == 3 and (view.shape[2] <= 1 or view.stride(2) == 1)


def _loop_rows(op: Op) -> None:
    """One call of the compiled loop for the op's rows; the op holds both views and id
    arrays alive while it runs without the GIL."""
    size = op.src_view.element_size()
    sides, arrays = [], []
    for view, ids in ((op.dst_view, op.dst), (op.src_view, op.src)):
        if isinstance(ids, int):
            address, start = 0, ids
        else:  # (plan ids are int64 already: no copy; a slice of them is contiguous)
            arrays.append(np.ascontiguousarray(ids, dtype=np.int64))
            address, start = arrays[-1].ctypes.data, 0
        sides.append((view.data_ptr(), view.stride(0) * size, view.stride(1) * size, address,
                      start, view.shape[0]))  # (rows: the loop checks every index)
    HOST_ROWS.copy_rows(*sides[0], *sides[1], op.count, op.src_view.shape[1],
                        op.src_view.shape[2] * size, op.streaming)


def _staged(src: torch.Tensor, dst: torch.Tensor, src_ids: np.ndarray,
            dst_ids: np.ndarray) -> None:
    row_numel = src[0].numel()
    rows = max(1, STAGE_BYTES // (row_numel * src.element_size()))
    buffers = _stage.__dict__.setdefault("buffers", {})
    buf = buffers.get(src.dtype)
    if buf is None or buf.numel() < rows * row_numel:
        buf = buffers[src.dtype] = torch.empty(rows * row_numel, dtype=src.dtype)
    stage = buf[:rows * row_numel].view(rows, *src.shape[1:])
    ids = torch.from_numpy(src_ids)
    target = dst.numpy()
    for a in range(0, len(src_ids), rows):
        part = stage[:min(rows, len(src_ids) - a)]
        torch.index_select(src, 0, ids[a:a + rows], out=part)
        target[dst_ids[a:a + rows]] = part.numpy()


_serial_lock = threading.Lock()


def _copy_thread() -> None:
    """A copy pool's worker, started lazily (at the first copy): off the engine's cores,
    then single-threaded torch."""
    join_our_cpus()
    serial_torch_thread()


def serial_torch_thread() -> None:
    """Make torch kernels on the calling thread single-threaded, leaving every
    other thread as it was. `torch.set_num_threads` sets this thread's OpenMP
    team size but also the default that threads starting later pick up; a
    throwaway thread puts that default back."""
    with _serial_lock:
        torch.get_num_threads()  # first torch call of a thread resets its team size: do it now
        default = [1]
        probe = threading.Thread(target=lambda: default.__setitem__(0, torch.get_num_threads()))
        probe.start()
        probe.join()
        # torch._C's own function: vLLM's CPU worker replaces `torch.set_num_threads` with a
        # warning stub (it must not resize its bound threads; ours is only this thread's).
        torch._C.set_num_threads(1)
        restore = threading.Thread(target=torch._C.set_num_threads, args=(default[0],))
        restore.start()
        restore.join()
