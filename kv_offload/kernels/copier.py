"""BlockCopier: the one entry point for batched page copies.

Built once per (canonical view, host pool); then each job is planned once
(`plan`) and moved with one call: `copy` (waits) or `submit` (returns a handle
with `done()`/`wait()`). Engine memory on the CPU is copied by `CpuCopier`, on
the spot. Engine memory on a GPU is copied by `CudaCopier` through a
`CudaRuntime` (cupy in production); passing `runtime=` runs that same GPU code
path against any runtime, e.g. the tests' host executor over CPU memory.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from kv_offload.canonical import CanonicalKVCaches
from kv_offload.errors import TransferError
from kv_offload.kernels.cpu import CpuCopier
from kv_offload.kernels.geometry import HostSlotLayout, Segment, build_segments
from kv_offload.kernels.plan import CopyPlan, Direction, IdsLike, plan_copy
from kv_offload.kernels.runtime import CudaRuntime, EngineReady


class BlockCopier:
    """Copies blocks of a canonical view to and from slots of a host pool."""

    def __init__(self, canonical: CanonicalKVCaches, pool: torch.Tensor,
                 layout: HostSlotLayout | None = None,
                 runtime: CudaRuntime | None = None) -> None:
        self.canonical = canonical
        self.layout = layout or HostSlotLayout.from_canonical(canonical)
        self.pool = pool
        self.segments: list[list[Segment]] = build_segments(canonical, self.layout, pool)
        devices = {t.tensor.device for t in canonical.tensors}
        if len(devices) > 1:
            raise TransferError(f"canonical tensors live on several devices: {devices}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self._block_bytes = [canonical.data_bytes_per_block(g)
                             for g in range(len(canonical.group_refs))]
        if runtime is None and self.device.type == "cuda":
            from kv_offload.kernels.cuda_runtime import CupyRuntime  # needs cupy: lazily

            runtime = CupyRuntime(self.device)
        self.runtime = runtime
        if runtime is not None:
            from kv_offload.kernels.cuda import CudaCopier

            runtime.check_host_pool(pool)
            self._cuda = CudaCopier(self.segments, runtime)
        else:
            self._cpu = CpuCopier(self.segments)

    @property
    def asynchronous(self) -> bool:
        """Whether copies run on streams (GPU path) rather than on the spot."""
        return self.runtime is not None

    def close(self) -> None:
        """Stop the copy threads (CPU); later copies start them again."""
        if not self.asynchronous:
            self._cpu.close()

    def last_strategies(self, direction: Direction) -> tuple[str, ...]:
        """The strategies (CPU) or paths (GPU) the last copy in `direction` used."""
        if self.asynchronous:
            return self._cuda.last_paths.get(direction, ())
        return self._cpu.last_strategies.get(direction, ())

    @property
    def num_slots(self) -> int:
        return int(self.pool.shape[0])

    def plan(self, direction: Direction,
             transfers: Mapping[int, tuple[IdsLike, IdsLike]]) -> CopyPlan:
        """Validate `{group: (block_ids, slot_ids)}`; raises TransferError."""
        return plan_copy(direction, transfers, num_blocks=self.canonical.num_blocks,
                         num_slots=self.num_slots, block_bytes=self._block_bytes)

    def engine_ready(self) -> EngineReady:
        """An event recorded now on the calling thread's current stream (the
        engine's): a copy submitted with it runs after the engine's work so far."""
        return self.runtime.record_current() if self.asynchronous else EngineReady(None)

    def copy(self, plan: CopyPlan, strategy: str | None = None) -> int:
        """Move `plan` and wait for it; returns the bytes moved. `strategy` forces one
        strategy (CPU: runs, gather, scatter, staged; GPU: dma, batch, kernel): for
        tests and benchmarks. GPU: after the work queued on the current stream."""
        if self.asynchronous:
            job = self._cuda.submit(plan, self.engine_ready(), strategy)
            job.wait()
            if job.error is not None:
                raise job.error
            return plan.num_bytes
        return self._cpu.copy(plan, strategy)

    def submit(self, plan: CopyPlan, ready: EngineReady | None = None,
               strategy: str | None = None, timeout_s: float | None = None,
               cancelled: threading.Event | None = None):
        """Start moving `plan`; returns a handle with `done()` and `wait()` (and
        `error`: the exception that failed it, or None).
        GPU: enqueued on the direction's stream after `ready` (None: no wait), no
        host wait. CPU: the copy happens here and the handle is already done; past
        `timeout_s` (or once `cancelled` is set) the copy is cancelled and `CopyOverrun`
        raised, whose `run` ends when the copy threads have (kernels/cpu.py)."""
        if self.asynchronous:
            return self._cuda.submit(plan, ready, strategy)
        self._cpu.copy(plan, strategy, timeout_s, cancelled)
        return _Done()

    @property
    def descriptor_pool(self):
        """The GPU path's pool of pinned descriptor buffers (None on the CPU path)."""
        return self._cuda.descriptors if self.asynchronous else None


class _Done:
    error = None

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


def copy_blocks(canonical: CanonicalKVCaches, pool: torch.Tensor, group: int,
                block_ids: IdsLike, slot_ids: IdsLike, direction: Direction) -> int:
    """One-shot helper: copy one group's blocks (slow to set up; tests and tools)."""
    copier = BlockCopier(canonical, pool)
    return copier.copy(copier.plan(direction, {group: (block_ids, slot_ids)}))
