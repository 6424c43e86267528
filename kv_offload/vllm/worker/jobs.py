"""The worker's records of the jobs it submitted, and what each finished job adds to the
stats (one concern out of `worker/offload_worker.py`: bookkeeping, no locking, no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kv_offload.store.jobs import TieredResult
from kv_offload.types import Direction
from kv_offload.vllm.stats import KVOffloadStats


@dataclass
class Job:
    request_id: str | None  # loads: the request; stores: None
    step: int  # the plan step that submitted it
    started: float
    num_blocks: int
    num_bytes: int
    abandoned: bool = False  # a store the engine stopped waiting for
    in_step: bool = False  # a load finished before this step's forward (see in_step_loads.py)
    block_ids: list[int] = field(default_factory=list)  # in-step loads: its engine blocks
    layers: Any = None  # a load copied layer by layer: its LayerSteps (worker/layers.py)


@dataclass(frozen=True)
class Outcome:
    result: TieredResult
    job: Job
    seconds: float


def record_outcome(outcome: Outcome, stats: KVOffloadStats) -> None:
    """Count one finished job in `stats`: blocks, bytes, seconds, failures."""
    result, job = outcome.result, outcome.job
    failed_blocks = sum(len(ids) for ids in result.failed.values())
    if result.direction is Direction.LOAD:
        stats.record_load(job.num_blocks, job.num_bytes, outcome.seconds, failed_blocks)
        return
    # (`skipped` counts keys: the same as blocks unless a key was listed twice)
    skipped = min(job.num_blocks, result.skipped)
    stored = job.num_blocks - skipped
    stats.record_store(stored, job.num_bytes * stored // max(1, job.num_blocks),
                       outcome.seconds, max(0, failed_blocks - skipped),
                       skipped_blocks=skipped)
