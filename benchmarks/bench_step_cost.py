"""What the connector adds to one vLLM engine step, with 1,000,000 keys on "disk" (issue 11 §2).

1. Per-step cost, scheduler side and worker side apart (p50 / p99 / max over the steps),
   with `--keys` keys already in the storage tier (a synthetic index: `step_cost_tier.py`)
   and `--requests` requests in the system (`step_cost_engine.py`: vLLM's real Request and
   SchedulerOutput objects, our real scheduler and worker over CPU KV caches). Two phases:
   the first steps, while the inventory reaches the scheduler, and the steady state after
   `--warmup-steps` (the first requests' prefills), `--steady-steps` long.
   Scheduler side = lookups (+ after_alloc, source_of) + build_meta + apply_worker_meta +
   loads_finished + request_finished; worker side = step_started + wait_for_engine_copies
   (only in steps whose metadata says `wait_for_stores`: both as the connector's
   handle_preemptions; the old tree waited every step) + start_loads + start_stores (after
   the forward, as vLLM 0.32 calls them) + finished_loads + report + take_stats. The
   simulated engine hands out free blocks as vLLM does (least recently freed first).
   Pickling our metadata across vLLM's process boundary is timed apart ("ipc").
   Goal: p99 < 1 ms on each side. Each
   call is timed twice: wall clock (what the engine thread waited, including waits for
   the worker lock while the pump holds it, garbage collection, and, on a shared machine,
   other processes) and the engine thread's CPU time (the work itself).
2. Store planning over a 128k-token prefill in 2048-token chunks, then 256 decode tokens
   (`step_cost_prefill.py`): full attention, and sliding window + full attention.
   Goal: < 5 ms in total for the prefill.

    python benchmarks/bench_step_cost.py --json step-cost.json
    # before/after: the same measurements on other trees (e.g. commit 2505ae9), one after
    # the other in child processes, and a table with the ratios to the first:
    git worktree add /tmp/before 2505ae9
    python benchmarks/bench_step_cost.py --before /tmp/before --json step-cost.json
    # the inventory's report batch against the cost of a step while it streams:
    python benchmarks/bench_step_cost.py --skip-prefill --report-cap 1024 --warmup-steps 0

The tree under test is whatever `kv_offload` imports (`PYTHONPATH`); `step_cost_compat.py`
adapts to the older API. The start-up heap is frozen as vLLM's engine does
(`--no-gc-freeze`: not), and collections during the steps are counted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from step_cost_compat import API, make_worker, storage_key_of
from step_cost_engine import SimEngine, Workload
from step_cost_prefill import PrefillCase, plan_prefill
from step_cost_report import print_calls, print_comparison, print_prefills, print_steps
from step_cost_stats import phase_summary
from step_cost_tier import SyntheticTier
from vllm import SamplingParams
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

import kv_offload
from kv_offload.config import OffloadConfig
from kv_offload.specs import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from kv_offload.testing.engine_alloc import allocate_kv_caches

try:  # the package's layout since issue 44
    from kv_offload.vllm.scheduler.offload_scheduler import OffloadScheduler
except ImportError:  # an older tree (--before)
    from kv_offload.vllm.scheduler_side import OffloadScheduler
try:
    from kv_offload.vllm.worker import offload_worker as worker_side
except ImportError:
    from kv_offload.vllm import worker_side

BLOCK = 16
ATTN = dict(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)
GOAL_STEP_P99_MS = 1.0
GOAL_PREFILL_MS = 5.0


def model_specs(model: str, window: int = 1024) -> list:
    full = FullAttentionSpec(**ATTN)
    if model == "full":
        return [full]
    return [full, SlidingWindowSpec(sliding_window=window, **ATTN)]


def request_factory():
    init_none_hash(sha256)  # as vLLM's EngineCore does, with the default algorithm
    hasher = get_request_block_hasher(BLOCK, sha256)

    def make(req_id: str, tokens: list[int]) -> Request:
        return Request(req_id, tokens, SamplingParams(max_tokens=1 << 20), None,
                       block_hasher=hasher)
    return make


# --- 1. per-step cost ---

def pending_changes(worker) -> int:
    """Key changes the worker has not reported yet (0 where the tree cannot tell)."""
    store = getattr(worker, "store", None)
    view = getattr(store, "view", None)
    return getattr(view, "num_pending", 0) + len(getattr(worker, "_report_changes", ()))


def run_steps(args) -> dict:
    rng = random.Random(args.seed)
    specs = model_specs(args.model)
    groups = [KVCacheGroup([f"layers.{g}.a", f"layers.{g}.b"], spec)
              for g, spec in enumerate(specs)]
    make_request = request_factory()
    tokens = lambda n: [rng.randrange(1, 30000) for _ in range(n)]  # noqa: E731
    documents = [tokens(rng.randrange(1024, 3072, BLOCK)) for _ in range(64)]
    system_prompts = [tokens(rng.randrange(256, 1024, BLOCK)) for _ in range(8)]
    doc_keys = {(bytes(h), g) for i, doc in enumerate(documents)
                for h in make_request(f"doc-{i}", doc).block_hashes for g in range(len(specs))}
    inventory = [storage_key_of(key) for key in doc_keys]
    inventory += [storage_key_of((rng.randbytes(32), rng.randrange(len(specs))))
                  for _ in range(args.keys - len(inventory))]
    rng.shuffle(inventory)
    num_blocks = args.engine_blocks * len(specs)
    _, caches = allocate_kv_caches(groups, num_blocks, "LBHNC")  # vLLM CPU's layout
    block_bytes = sum(2 * spec.page_size_bytes for spec in specs)
    shared = None
    if getattr(args, "tier", "synthetic") != "synthetic":  # (step_cost_shared.py)
        from step_cost_shared import start_shared

        shared = start_shared(args.tier, inventory, {storage_key_of(k) for k in doc_keys},
                              block_bytes, args)
        tier = shared.tier
        inventory_left, tier_counts = shared.inventory_left, shared.counts
    else:
        tier = SyntheticTier(inventory, page_bytes=block_bytes)
        inventory_left, tier_counts = tier.inventory_left, lambda: dict(tier.counts)
    worker = make_worker(OffloadConfig(cpu_bytes_to_use=args.host_mib << 20), caches, groups,
                         num_blocks, tier)
    scheduler = OffloadScheduler(specs, BLOCK, 1)
    workload = Workload(num_requests=args.requests, max_batched_tokens=args.batched_tokens,
                        forward_s=args.forward_ms / 1e3, block_size=BLOCK)
    engine = SimEngine(workload, len(specs), num_blocks, scheduler, worker, make_request,
                       documents, system_prompts, seed=args.seed)
    if args.gc_freeze:  # as vLLM does once its engine and workers are up
        freeze_gc_heap()
    engine.gc.take()  # (start-up collections are not a step's)
    if args.report_cap is not None and hasattr(worker_side, "REPORT_MAX_KEYS"):
        worker_side.REPORT_MAX_KEYS = args.report_cap  # read by report() at every call
    cap = getattr(worker_side, "REPORT_MAX_KEYS", None)
    records, reported, stream_end, delay = [], 0, None, None
    started = time.monotonic()
    try:
        while True:
            record = engine.step()
            records.append(record)
            # Streaming until the tier has listed its whole inventory and the worker has
            # reported it (no more than a step's worth of changes left behind).
            streaming = reported < len(inventory) or record.report_keys == cap or \
                inventory_left() > 0 or pending_changes(worker) > 1024
            reported += record.report_keys
            if stream_end is None and not streaming:
                stream_end = record.step  # the first step after the inventory arrived
                if shared is not None:  # another engine writes while this one steps
                    shared.start_writer(args.writer_rate)
            if stream_end is not None and \
                    record.step + 1 >= max(stream_end, args.warmup_steps) + args.steady_steps:
                break
        if shared is not None:
            shared.stop_writer()
            if args.delay_keys > 0:  # (0: no probe; its writer would write until stopped)
                delay = shared.measure_delay(args.delay_keys)
    finally:
        engine.gc.close()
        worker.shutdown()
        if shared is not None:
            shared.close()
    wall = time.monotonic() - started
    first, steady = records[:stream_end], records[-args.steady_steps:]
    return {
        "model": args.model, "keys": args.keys, "stored_keys": len(inventory),
        "requests": args.requests,
        "forward_ms": args.forward_ms, "batched_tokens": args.batched_tokens,
        "report_cap": cap, "steps": len(records), "wall_s": wall, "gc_freeze": args.gc_freeze,
        "tier": tier_counts() if shared is None else shared.final_counts,
        "shared": None if shared is None else {
            "kind": args.tier, "fill_s": shared.fill_s, "start_up_s": shared.start_up_s,
            "server": shared.server_notes, "writer_rate": args.writer_rate, "delay": delay,
            "helpers_niced": shared.niced},
        "first_steps": phase_summary(first),
        "steady_state": phase_summary(steady),
    }


# --- 2. store planning of a long prefill ---

def run_prefills(args) -> list[dict]:
    """Each case `--prefill-repeats` times; the run of median planning time is kept."""
    make_request = request_factory()
    cases = [PrefillCase("full attention", model_specs("full"), args.prefill_tokens,
                         args.chunk_tokens, args.decode_tokens),
             PrefillCase("sliding window 1024 + full", model_specs("hybrid"),
                         args.prefill_tokens, args.chunk_tokens, args.decode_tokens)]
    rows = []
    for case in cases:
        runs = sorted((plan_prefill(case, make_request, BLOCK)
                       for _ in range(args.prefill_repeats)),
                      key=lambda r: r["prefill_planning_ms"])
        row = runs[len(runs) // 2]
        row["prefill_planning_ms_runs"] = [r["prefill_planning_ms"] for r in runs]
        rows.append(row)
    return rows


# --- main ---

def measure(args) -> dict:
    tree = Path(kv_offload.__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no",
                       "kv_offload"], capture_output=True, text=True).stdout.strip():
        commit += "+changes"  # the tree's kv_offload differs from its commit
    result = {"label": f"{commit or tree} ({API})", "tree": str(tree), "commit": commit,
              "api": API, "load_average_start": os.getloadavg()}
    if not args.skip_prefill:
        result["prefill"] = run_prefills(args)
        print_prefills(result)
    if not args.skip_steps:
        result["steps"] = run_steps(args)
        print_steps(result)
        print_calls(result)
    result["load_average_end"] = os.getloadavg()
    print(f"load average (1, 5, 15 min) at start {result['load_average_start']}, "
          f"at end {result['load_average_end']}")
    return result


def run_child(tree: str, argv: list[str]) -> dict:
    """Measure `tree` in a fresh process (its own kv_offload on PYTHONPATH)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
        subprocess.run([sys.executable, __file__, *argv, "--json", str(out)], env=env,
                       check=True, cwd=tmp)
        return json.loads(out.read_text())["results"][0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--before", metavar="TREE", help="also measure this tree (e.g. a "
                        "worktree of 2505ae9) and compare; each tree runs in its own child "
                        "process, one after the other")
    parser.add_argument("--after", metavar="TREE", nargs="+",
                        default=[str(Path(__file__).resolve().parent.parent)],
                        help="the trees compared with --before (default: this script's)")
    parser.add_argument("--keys", type=int, nargs="+", default=[1_000_000],
                        help="keys already stored (default 1000000); several: one "
                             "measurement each, e.g. --keys 0 1000000 (not with --before)")
    parser.add_argument("--plot", metavar="PATH", type=_plot_path,
                        help="also draw the steady-state step-cost CDF per --keys in this PNG")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--model", choices=("full", "hybrid"), default="full")
    parser.add_argument("--warmup-steps", type=int, default=150)
    parser.add_argument("--steady-steps", type=int, default=300)
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--batched-tokens", type=int, default=2048)
    parser.add_argument("--engine-blocks", type=int, default=40_000, help="per group")
    parser.add_argument("--host-mib", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=128 * 1024)
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tier", choices=("synthetic", "valkey", "s3"), default="synthetic",
                        help="the storage tier holding the --keys keys: the synthetic index, "
                        "a real ValkeyTier on a loopback redis-server, or a real S3Tier on a "
                        "loopback moto server (step_cost_shared.py, step_cost_s3.py; with "
                        "--writer-rate, --delay-keys)")
    parser.add_argument("--s3-pages-per-refresh", type=int, default=1,
                        help="--tier s3: the tier's list_pages_per_refresh (default 1, the "
                        "tier's): a pass over the prefix takes keys / 1000 / this polls")
    parser.add_argument("--writer-rate", type=float, default=200.0)
    parser.add_argument("--helpers-niced", action="store_true",
                        help="--tier valkey/s3: run the server and the other engine's writer "
                        "at nice 19 (on a fleet they are other machines; here they share the "
                        "engine's cores)")
    parser.add_argument("--delay-keys", type=int, default=200,
                        help="--tier valkey/s3: keys another engine writes after the steps, "
                        "each timed until a lookup finds it (0: skip that probe)")
    parser.add_argument("--report-cap", type=int, help="key changes per worker report "
                        "(sets worker_side.REPORT_MAX_KEYS for this run; default: the tree's)")
    parser.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                        help="do not freeze the start-up heap (vLLM's engine and GPU workers "
                        "do, so the collector skips it)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    child_argv = _without(argv, ("--json", "--before", "--after", "--plot"))
    if args.before:
        if len(args.keys) > 1:
            parser.error("--before compares trees at one --keys count")
        results = [run_child(tree, child_argv) for tree in [args.before, *args.after]]
        print_comparison(results)
    else:
        results = [measure(argparse.Namespace(**{**vars(args), "keys": keys}))
                   for keys in args.keys]
    if args.json:
        meta = {"python": platform.python_version(), "cpus": os.cpu_count(),
                "load_average": os.getloadavg(), "argv": argv,
                "goals_ms": {"step_p99": GOAL_STEP_P99_MS, "prefill_total": GOAL_PREFILL_MS}}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        from kv_offload.tools.plots import run_note, step_cost_cdf

        step_cost_cdf(results, args.plot, run_note())
        print(f"wrote {args.plot}")
    return 0


def _plot_path(text: str) -> str:
    # (imported here: a --before child runs an older tree, which has no plots module)
    from kv_offload.tools.plots import plot_path

    return plot_path(text)


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """`argv` less these options and their values (all up to the next option)."""
    out, skipping = [], False
    for arg in argv:
        if arg.startswith("--"):
            skipping = arg.split("=", 1)[0] in options
            if skipping:
                continue
        if not skipping:
            out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
