"""Store planning over the life of one long request, scheduler side only.

A 128k-token prompt is prefilled in chunks (2048 tokens per step by default: 64 steps,
8192 blocks of 16 tokens per group), then decodes a few hundred tokens. Every step goes
through `OffloadScheduler.build_meta` with vLLM's real `Request` (block hashes from vLLM's
hasher, computed before timing starts: the prompt is known when the request arrives) and
`SchedulerOutput`; the blocks it plans to store are reported back as stored in host memory
after each step, as a worker would (timed apart). Planning time = the sum of `build_meta`
over the prefill (wall-clock, and the thread's CPU time); the decode steps after it are
summed apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from step_cost_compat import host_report
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

try:  # the package's layout since issue 44
    from kv_offload.vllm.scheduler.offload_scheduler import OffloadScheduler
except ImportError:  # an older tree (--before)
    from kv_offload.vllm.scheduler_side import OffloadScheduler


@dataclass(frozen=True)
class PrefillCase:
    name: str
    specs: list
    prompt_tokens: int = 128 * 1024
    chunk_tokens: int = 2048
    decode_tokens: int = 256


def plan_prefill(case: PrefillCase, make_request, block_size: int) -> dict:
    specs = case.specs
    sched = OffloadScheduler(specs, block_size, 1)
    sched.apply_worker_meta(host_report([], -1, 1 << 20))  # rank 0 is up, holds nothing
    tokens = [(7 * i) % 30000 + 1 for i in range(case.prompt_tokens)]
    request = make_request("long", tokens)
    blocks_per_group = -(-case.prompt_tokens // block_size) + case.decode_tokens // block_size + 1
    ids = [list(range(1 + g * blocks_per_group, 1 + (g + 1) * blocks_per_group))
           for g in range(len(specs))]
    allocated = 0

    def grow(total_tokens: int) -> tuple[list[int], ...]:
        nonlocal allocated
        needed = -(-total_tokens // block_size)
        new = tuple(group_ids[allocated:needed] for group_ids in ids)
        allocated = max(allocated, needed)
        return new

    start = time.perf_counter_ns()
    looked_up = sched.num_new_matched_tokens(request, 0)
    lookup_ns = time.perf_counter_ns() - start
    sched.after_alloc(request, tuple([] for _ in specs), 0)
    prefill_ns = decode_ns = report_ns = prefill_cpu_ns = 0
    stored = steps = 0
    max_step_ns = 0
    first = True
    while request.num_computed_tokens < request.num_tokens:
        computed = request.num_computed_tokens
        prefill = computed < len(tokens)
        chunk = min(case.chunk_tokens, request.num_tokens - computed)
        new_ids = grow(computed + chunk)
        if first:
            output = _output([NewRequestData.from_request(request, new_ids)], None, request,
                             chunk)
            first = False
        else:
            output = _output([], new_ids if any(new_ids) else None, request, chunk)
        cpu, start = time.thread_time_ns(), time.perf_counter_ns()
        meta = sched.build_meta(output)
        took, cpu = time.perf_counter_ns() - start, time.thread_time_ns() - cpu
        max_step_ns = max(max_step_ns, took)
        if prefill:
            prefill_ns += took
            prefill_cpu_ns += cpu
        else:
            decode_ns += took
        planned = [(h, g) for g, (hashes, _) in meta.stores.items() for h in hashes]
        stored += len(planned)
        request.num_computed_tokens += chunk
        start = time.perf_counter_ns()
        sched.apply_worker_meta(host_report(planned, meta.step, 1 << 20))
        report_ns += time.perf_counter_ns() - start
        steps += 1
        if request.num_computed_tokens == request.num_tokens and \
                request.num_output_tokens < case.decode_tokens:
            request.append_output_token_ids(1)  # sampled: one more token to compute
    return {
        "case": case.name,
        "prompt_tokens": case.prompt_tokens,
        "chunk_tokens": case.chunk_tokens,
        "decode_tokens": case.decode_tokens,
        "groups": [type(spec).__name__ for spec in specs],
        "steps": steps,
        "blocks_planned": stored,
        "lookup_ms": lookup_ns / 1e6,
        "lookup_tokens": looked_up[0],
        "prefill_planning_ms": prefill_ns / 1e6,
        "prefill_planning_cpu_ms": prefill_cpu_ns / 1e6,
        "decode_planning_ms": decode_ns / 1e6,
        "total_planning_ms": (prefill_ns + decode_ns) / 1e6,
        "max_step_ms": max_step_ns / 1e6,
        "apply_reports_ms": report_ns / 1e6,
    }


def _output(new, new_block_ids, request, tokens: int) -> SchedulerOutput:
    cached = CachedRequestData.make_empty()
    if not new:
        cached = CachedRequestData(
            req_ids=[request.request_id], resumed_req_ids=set(), new_token_ids=[[]],
            all_token_ids={}, new_block_ids=[new_block_ids],
            num_computed_tokens=[request.num_computed_tokens],
            num_output_tokens=[request.num_output_tokens])
    return SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached,
        num_scheduled_tokens={request.request_id: tokens}, total_num_scheduled_tokens=tokens,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
        free_encoder_mm_hashes=[])
