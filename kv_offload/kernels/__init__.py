"""Batched page copies between canonical KV caches and host slots (CPU and CUDA)."""

from kv_offload.kernels.copier import BlockCopier, copy_blocks
from kv_offload.kernels.geometry import HostSlotLayout, Segment, build_segments
from kv_offload.kernels.plan import CopyPlan, Direction, GroupPlan, plan_copy
from kv_offload.kernels.runtime import CudaRuntime, EngineReady

__all__ = [
    "BlockCopier",
    "CopyPlan",
    "CudaRuntime",
    "Direction",
    "EngineReady",
    "GroupPlan",
    "HostSlotLayout",
    "Segment",
    "build_segments",
    "copy_blocks",
    "plan_copy",
]
