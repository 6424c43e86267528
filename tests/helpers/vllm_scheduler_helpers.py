"""Helpers for the OffloadScheduler tests: vLLM's real Request, SchedulerOutput and spec
classes (import this module only after `pytest.importorskip("vllm")`)."""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1 import kv_cache_interface as vkv
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.request import Request

from kv_offload.types import KeyChange, Location
from kv_offload.vllm.metadata import KVOffloadWorkerMetadata, RankReport
from kv_offload.vllm.scheduler.offload_scheduler import OffloadScheduler
from kv_offload.vllm.spec_translation import translate_groups

ABSENT, IN_HOST, ON_DISK = Location.ABSENT, Location.HOST, Location.STORAGE
BLOCK = 32
ATTN = dict(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
__all__ = ["ABSENT", "ATTN", "BLOCK", "IN_HOST", "ON_DISK", "CachedRequestData",
           "KVOffloadWorkerMetadata", "NewRequestData", "OffloadScheduler", "cached_step",
           "rank_meta",
           "full_attention", "hashes_of", "keys", "mixed_block_sizes", "output", "report",
           "request_factory", "run_hit", "scheduler_for", "stored", "vkv"]


def request_factory():
    """`make(req_id, num_tokens, first_token=1)` -> a vLLM Request with real block hashes."""
    init_none_hash(sha256)  # as vLLM's EngineCore does, with the default algo
    hasher = get_request_block_hasher(BLOCK, sha256)

    def make(req_id: str, num_tokens: int, first_token: int = 1) -> Request:
        return Request(req_id, list(range(first_token, first_token + num_tokens)),
                       SamplingParams(max_tokens=16), None, block_hasher=hasher)
    return make


def scheduler_for(*vllm_specs: vkv.KVCacheSpec, world_size: int = 1) -> OffloadScheduler:
    """Our scheduler over vLLM specs, translated the way the connector does it."""
    config = vkv.KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[],
        kv_cache_groups=[vkv.KVCacheGroupSpec([f"layers.{g}"], spec)
                         for g, spec in enumerate(vllm_specs)])
    return OffloadScheduler([g.spec for g in translate_groups(config)], BLOCK, world_size)


def full_attention(world_size: int = 1) -> OffloadScheduler:
    return scheduler_for(vkv.FullAttentionSpec(**ATTN), world_size=world_size)


def keys(request: Request, blocks, group: int = 0) -> list[tuple[bytes, int]]:
    return [(bytes(request.block_hashes[i]), group) for i in blocks]


def rank_meta(rank: int, changed=(), new=IN_HOST, *, reset: bool = False,
              reflected_step: int = -1, read_bytes_per_s: float = 0.0,
              stalled: tuple[str, ...] = (), step: int = -1) -> KVOffloadWorkerMetadata:
    """One rank's report: `changed` keys now at `new` (its measured read rate, the requests
    whose given-up in-step loads still run on it, the last plan step it covers)."""
    changes = tuple(KeyChange(k, new) for k in changed)
    return KVOffloadWorkerMetadata({rank: RankReport.of(changes, reset, reflected_step,
                                                        read_bytes_per_s, stalled, step)})


def report(sched: OffloadScheduler, rank: int, changed=(), old=ABSENT, new=IN_HOST,
           **kwargs) -> None:
    """Apply a rank's report (`old` documents the transition; the protocol sends `new`)."""
    sched.apply_worker_meta(rank_meta(rank, changed, new, **kwargs))


def output(new=(), cached: CachedRequestData | None = None, scheduled=None,
           spec_tokens=None, preempted=()) -> SchedulerOutput:
    scheduled = scheduled or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens=spec_tokens or {}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[],
        preempted_req_ids=set(preempted))  # (vLLM 0.32 always sets it)


def cached_step(request: Request, new_block_ids, resumed: bool = False) -> CachedRequestData:
    return CachedRequestData(
        req_ids=[request.request_id], resumed_req_ids={request.request_id} if resumed else set(),
        new_token_ids=[[]], all_token_ids={}, new_block_ids=[new_block_ids],
        num_computed_tokens=[request.num_computed_tokens], num_output_tokens=[0])


def stored(meta, group: int = 0) -> list[tuple[bytes, int]]:
    hashes, ids = meta.stores.get(group, ([], []))
    return list(zip(hashes, ids))


def hashes_of(request: Request, blocks) -> list[bytes]:
    return [bytes(request.block_hashes[i]) for i in blocks]


def run_hit(sched: OffloadScheduler, request: Request, block_ids, local: int = 0):
    """Lookup, then vLLM's allocation; returns (tokens, async, load plan of the request)."""
    tokens, load_async, _ = sched.num_new_matched_tokens(request, local)
    sched.after_alloc(request, block_ids, tokens or 0)
    return tokens, load_async



def mixed_block_sizes() -> OffloadScheduler:
    """Sliding window (32-token blocks, window 64) beside full attention with 64-token
    blocks: vLLM hashes every 32 tokens (the gcd) and the full group uses every 2nd hash."""
    return scheduler_for(vkv.SlidingWindowSpec(sliding_window=64, **ATTN),
                         vkv.FullAttentionSpec(**{**ATTN, "block_size": 2 * BLOCK}))

