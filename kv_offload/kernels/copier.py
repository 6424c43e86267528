"""BlockCopier: the one entry point for batched page copies.

Built once per (canonical view, host pool); then each job is planned once
(`plan`) and moved with one call: `copy` (CPU engine memory: done on return)
or `submit` (CUDA engine memory: returns at once, completion via an event).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kv_offload.canonical import CanonicalKVCaches
from kv_offload.errors import TransferError
from kv_offload.kernels.cpu import CpuCopier
from kv_offload.kernels.geometry import HostSlotLayout, Segment, build_segments
from kv_offload.kernels.plan import CopyPlan, Direction, IdsLike, plan_copy


class BlockCopier:
    """Copies blocks of a canonical view to and from slots of a host pool."""

    def __init__(self, canonical: CanonicalKVCaches, pool: torch.Tensor,
                 layout: HostSlotLayout | None = None) -> None:
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
        if self.device.type == "cuda":
            from kv_offload.kernels.cuda import CudaCopier  # needs cupy: import lazily

            self._cuda = CudaCopier(self.segments, self.device)
        else:
            self._cpu = CpuCopier(self.segments)

    def close(self) -> None:
        """Stop the copy threads (CPU); later copies start them again."""
        if self.device.type != "cuda":
            self._cpu.close()

    def last_strategies(self, direction: Direction) -> tuple[str, ...]:
        """The CPU strategies the last copy in `direction` used (for benchmarks)."""
        return () if self.device.type == "cuda" else self._cpu.last_strategies.get(direction, ())

    @property
    def num_slots(self) -> int:
        return int(self.pool.shape[0])

    def plan(self, direction: Direction,
             transfers: Mapping[int, tuple[IdsLike, IdsLike]]) -> CopyPlan:
        """Validate `{group: (block_ids, slot_ids)}`; raises TransferError."""
        return plan_copy(direction, transfers, num_blocks=self.canonical.num_blocks,
                         num_slots=self.num_slots, block_bytes=self._block_bytes)

    def copy(self, plan: CopyPlan, strategy: str | None = None) -> int:
        """Move `plan` and wait for it; returns the bytes moved. `strategy` forces one
        strategy (CPU: runs, gather, scatter, staged; CUDA: dma, kernel): for tests
        and benchmarks."""
        if self.device.type == "cuda":
            handle = self._cuda.submit(plan, strategy=strategy)
            handle.wait()
            return plan.num_bytes
        return self._cpu.copy(plan, strategy)

    def submit(self, plan: CopyPlan, after: torch.cuda.Event | None = None):
        """Start moving `plan`; returns a handle with `done()` and `wait()`.
        CUDA: enqueued on the direction's stream after `after` (default: after the
        work queued so far on the caller's current stream); no host wait.
        CPU: the copy happens here and the handle is already done."""
        if self.device.type == "cuda":
            return self._cuda.submit(plan, after)
        self._cpu.copy(plan)
        return _Done()


class _Done:
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


def copy_blocks(canonical: CanonicalKVCaches, pool: torch.Tensor, group: int,
                block_ids: IdsLike, slot_ids: IdsLike, direction: Direction) -> int:
    """One-shot helper: copy one group's blocks (slow to set up; tests and tools)."""
    copier = BlockCopier(canonical, pool)
    return copier.copy(copier.plan(direction, {group: (block_ids, slot_ids)}))
