"""A small host tier in front of a big disk tier, on a Zipf trace (vLLM CPU engine).

    python benchmarks/bench_zipf.py --json /tmp/zipf.json

Issue 11 §3: with the host tier much smaller than the disk tier, the tokens served from
our tiers must approach what the disk tier's capacity allows, not what the host tier's does.

The trace (zipf_trace.py, seeded): N documents of whole blocks of random tokens; each
request is one document, picked by a Zipf law, plus a question of its own shorter than a
block. It runs in rounds (consecutive runs of the trace without a repeated document, at
most `--round` requests, sent to vLLM together), and vLLM's own prefix cache is dropped
between rounds (`llm.reset_prefix_cache()`), so every hit comes from our tiers. Budgets
are derived from the model: KV bytes per block = block_size x layers x kv_heads x head_dim
x 2 (K and V) x dtype bytes; the disk budget holds `--disk-fraction` of the documents'
blocks (files: data plus an aligned header), the host tier `--host-fraction`.

Two engines run the same rounds in child processes (in-process engine core, block size 32,
eager, prefix caching on): with the connector (host + disk tiers) and without it. Reported:
- served: tokens our tiers served: the sum of vLLM's per-request `num_cached_tokens` (a
  request whose load failed is recomputed whole and counts what it finally got; vLLM's own
  cache, source 'device' in `vllm:prompt_tokens_cached_by_source`, must serve nothing);
- ideal LRU of the disk budget and of the host budget: the same trace replayed through an
  LRU cache of that many blocks with vLLM's full-attention hit rule (zipf_trace.IdealLRU);
- ratio served / ideal-disk (goal >= 0.8), and whether every request generated the same
  greedy tokens (and top-5 logprobs) as without the connector.
Per round, the connector's own counters (loads from host/disk, failed loads, stores skipped
for lack of host room) explain a shortfall. Also reported: the time the engine waited before
its forwards for the previous step's stores to be copied out of its blocks (the connector's
`handle_preemptions`), the cost of staging large stores through a small host tier.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zipf_trace

from kv_offload.tools.plots import plot_path, run_note, zipf_hits

BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
MODEL_SIZES = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2}
# float32, not bfloat16: a random-weight model's logits are nearly flat, and in bfloat16 two
# top tokens often round to the same value, so a different batch composition (the connector
# delays requests whose load is in flight) flips greedy picks of requests that got no hit at
# all. In float32 such ties are vanishingly rare and a different token means different KV.
DTYPE = "float32"
GOAL = 0.8
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
COUNTERS = ("engine_wait_s", "hit_tokens", "hit_tokens_host", "hit_tokens_disk", "load_blocks",
            "load_failed_blocks", "load_failed_jobs", "store_blocks", "store_failed_blocks",
            "store_skipped_blocks", "faults_scheduler", "faults_worker",
            "storage_read_failed_keys", "storage_write_failed_keys")
# (this benchmark's names -> the connector's stats keys; its tiers: host and disk)
STATS_KEYS = {"hit_tokens_host": "hit_tokens:host", "hit_tokens_disk": "hit_tokens:disk"}
GAUGES = {"host_bytes_used": ("bytes_used", "host"), "host_bytes_total": ("bytes_total", "host"),
          "disk_bytes_used": ("bytes_used", "disk"), "disk_bytes_total": ("bytes_total", "disk")}


# ----------------------------------------------------------------------------- child side

def _child(spec_path: Path) -> int:
    """Inside one engine process: run the rounds, write per-request results and counters."""
    from vllm import LLM, SamplingParams

    from kv_offload.vllm.connector import KVOffloadConnector
    from kv_offload.vllm.stats import gauge_sum

    spec = json.loads(spec_path.read_text())
    seen: dict[str, float] = {}  # every connector stats payload (both roles), summed

    observed = KVOffloadConnector.get_kv_connector_stats

    def observe(self):  # the connector's own stats, read on their way to vLLM's metrics
        stats = observed(self)
        if stats is not None:
            for name in COUNTERS:
                seen[name] = seen.get(name, 0) + stats.data.get(STATS_KEYS.get(name, name), 0)
            for name, (gauge, tier) in GAUGES.items():
                value = gauge_sum(stats.data, gauge, tier)
                if value is not None:
                    seen[name] = value
        return stats

    KVOffloadConnector.get_kv_connector_stats = observe
    waited = KVOffloadConnector.handle_preemptions

    def timed_wait(self, *args):  # before each forward: the wait for last step's store copies
        t0 = time.perf_counter()
        try:
            return waited(self, *args)
        finally:
            seen["engine_wait_s"] = seen.get("engine_wait_s", 0.0) + time.perf_counter() - t0
            seen["engine_waits"] = seen.get("engine_waits", 0) + 1

    KVOffloadConnector.handle_preemptions = timed_wait
    llm = LLM(model=spec["model"], block_size=BLOCK_SIZE, max_model_len=spec["max_model_len"],
              kv_cache_memory_bytes=64 * 1024 * 1024, enable_prefix_caching=True,
              enforce_eager=True, dtype=spec["dtype"], seed=0, max_num_seqs=spec["round"],
              disable_log_stats=False, kv_transfer_config=spec["kv_transfer_config"])
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True,
                            logprobs=5)
    requests, rounds = [], []
    sources_before: dict[str, float] = {}
    for r, prompts in enumerate(spec["rounds"]):
        if r and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")
        before = dict(seen)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        seconds = time.perf_counter() - t0
        for out in outs:
            requests.append({
                "round": r, "num_cached_tokens": out.num_cached_tokens or 0,
                "token_ids": list(out.outputs[0].token_ids),
                "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                             for step in (out.outputs[0].logprobs or [])]})
        by_source = _cached_by_source(llm)
        rounds.append({"seconds": seconds, **{k: seen.get(k, 0) - before.get(k, 0)
                                              for k in COUNTERS},
                       **{k: seen[k] for k in GAUGES if k in seen},
                       "vllm_cached_by_source": {k: v - sources_before.get(k, 0)
                                                 for k, v in by_source.items()
                                                 if v - sources_before.get(k, 0)}})
        sources_before = by_source
    Path(spec["result_path"]).write_text(json.dumps({"requests": requests, "rounds": rounds,
                                                     "totals": seen}))
    del llm  # the connector's shutdown flushes pending disk writes
    return 0


def _cached_by_source(llm: Any) -> dict[str, float]:
    """vLLM's own count of cached prompt tokens by source ('device' = its prefix cache)."""
    return {m.labels.get("source", "?"): m.value for m in llm.get_metrics()
            if m.name == "vllm:prompt_tokens_cached_by_source" and hasattr(m, "value")}


# ---------------------------------------------------------------------------- parent side

def _model_dir(args: argparse.Namespace) -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kv-offload"
    path = args.model_dir or default / f"bench-zipf-model-{DTYPE}"
    if (path / "config.json").exists():
        return path
    from kv_offload.testing.tiny_models import build_llama

    print(f"building the benchmark model in {path} ...", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    build_llama(building, max_positions=2048, dtype=DTYPE, **MODEL_SIZES)
    building.rename(path)  # whole or absent
    return path


def kv_bytes_per_block(model_dir: Path) -> int:
    """layers x kv_heads x head_dim x 2 (K, V) x dtype bytes, per token, times block size."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    per_token = (config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2
                 * DTYPE_BYTES[dtype])
    return per_token * BLOCK_SIZE


def file_bytes_per_block(data_bytes: int) -> int:
    """What one block's file takes against `fs_bytes_to_use`: aligned header, then data."""
    from kv_offload.backends.filesystem.fileformat import data_offset

    key = bytes(8 + 2 + 32)  # generation, group, a 32-byte block hash
    return data_offset(key, "0" * 16, data_bytes) + data_bytes


def _run_child(name: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    run_dir = work / name
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path, log_path = (run_dir / "spec.json", run_dir / "result.json",
                                        run_dir / "engine.log")
    spec_path.write_text(json.dumps({**spec, "result_path": str(result_path)}))
    result_path.unlink(missing_ok=True)  # (an earlier budget's run used this folder)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # engine core in-process
    print(f"  engine '{name}': {sum(map(len, spec['rounds']))} requests in "
          f"{len(spec['rounds'])} rounds (log {log_path}) ...", flush=True)
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        # cwd=run_dir: the checkout's top-level folders must not shadow installed packages.
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                               str(spec_path)], cwd=run_dir, env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"engine '{name}' failed (exit {proc.returncode}):\n"
                           f"{log_path.read_text()[-3000:]}")
    out = json.loads(result_path.read_text())
    out["wall_s"] = time.perf_counter() - t0
    return out


def _ideal(trace: list[zipf_trace.TraceRequest], capacity_blocks: int) -> list[int]:
    cache = zipf_trace.IdealLRU(capacity_blocks, BLOCK_SIZE)
    return [cache.serve(request.prompt) for request in trace]


def _max_logprob_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest |logprob difference| of a token in both top-5 lists, over the positions
    whose context is the same (up to the first differing generated token)."""
    worst = 0.0
    for step, (x, y) in enumerate(zip(a["logprobs"], b["logprobs"])):
        worst = max([worst, *(abs(v - y[t]) for t, v in x.items() if t in y)])
        if a["token_ids"][step] != b["token_ids"][step]:
            break
    return worst


def _summarise(trace, rounds, sizes, with_conn, without) -> dict[str, Any]:
    ideal_disk = _ideal(trace, sizes["disk_blocks"])
    ideal_host = _ideal(trace, sizes["host_slots"])
    served_by_request = [r["num_cached_tokens"] for r in with_conn["requests"]]
    served = sum(served_by_request)
    pairs = list(zip(trace, with_conn["requests"], without["requests"]))
    mismatched = [t.index for t, a, b in pairs if a["token_ids"] != b["token_ids"]]
    logprob_diff = max(_max_logprob_diff(a, b) for _, a, b in pairs)

    def device_tokens(run: dict[str, Any]) -> float:
        return sum(r["vllm_cached_by_source"].get("device", 0) for r in run["rounds"])

    local = {"with_connector": device_tokens(with_conn), "without": device_tokens(without),
             "without_num_cached_tokens": sum(r["num_cached_tokens"]
                                              for r in without["requests"])}
    per_round = []
    for stats, reqs in zip(with_conn["rounds"], rounds):
        idx = [t.index for t in reqs]
        per_round.append({**stats, "requests": len(reqs),
                          "ideal_disk_tokens": sum(ideal_disk[i] for i in idx),
                          "ideal_host_tokens": sum(ideal_host[i] for i in idx),
                          "served_tokens": sum(served_by_request[i] for i in idx)})
    short = [i for i, (a, b) in enumerate(zip(served_by_request, ideal_disk)) if a < b]
    ratio = served / sum(ideal_disk) if sum(ideal_disk) else None
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} request(s) generated other tokens than without "
                        f"the connector: {mismatched[:10]}")
    if any(local.values()):
        problems.append(f"vLLM's own prefix cache served tokens inside a round: {local}")
    if ratio is None or ratio < GOAL:
        problems.append(f"served / ideal-disk = {ratio} < goal {GOAL}")
    return {
        "served_tokens": served, "ideal_disk_tokens": sum(ideal_disk),
        "ideal_host_tokens": sum(ideal_host), "prompt_tokens": sum(len(t.prompt) for t in trace),
        "ratio_to_ideal_disk": ratio, "goal": GOAL,
        "ratio_ideal_host_to_ideal_disk": sum(ideal_host) / max(1, sum(ideal_disk)),
        "same_tokens": not mismatched, "mismatched_requests": mismatched,
        "max_logprob_diff": logprob_diff, "vllm_local_cache_tokens": local,
        "requests_short_of_ideal_disk": len(short),
        "tokens_short_of_ideal_disk": sum(ideal_disk[i] - served_by_request[i] for i in short),
        "connector_totals": with_conn["totals"], "per_round": per_round,
        "served_by_request": served_by_request, "ideal_disk_by_request": ideal_disk,
        "seconds": {"with_connector": with_conn["wall_s"], "without": without["wall_s"]},
        "problems": problems, "valid": not problems,
    }


def _print_table(s: dict[str, Any], sizes: dict[str, Any], args) -> None:
    mib = 1 << 20
    print(f"\nZipf({args.zipf}) trace: {args.requests} requests over {args.documents} documents "
          f"of {args.min_blocks}-{args.max_blocks} blocks x {BLOCK_SIZE} tokens, rounds of <= "
          f"{args.round}; Llama-like {MODEL_SIZES} {DTYPE}, {sizes['kv_bytes_per_block']} KV "
          f"bytes/block")
    print(f"documents {sizes['document_blocks']} blocks = "
          f"{sizes['document_kv_bytes'] / mib:.1f} MiB of KV; disk budget "
          f"{sizes['fs_bytes_to_use'] / mib:.1f} MiB = {sizes['disk_blocks']} block files "
          f"({sizes['document_blocks'] / sizes['disk_blocks']:.2f}x smaller than the "
          f"documents); host {sizes['cpu_bytes_to_use'] / mib:.2f} MiB = {sizes['host_slots']} "
          f"slots ({sizes['document_blocks'] / sizes['host_slots']:.1f}x smaller)\n")
    prompt = s["prompt_tokens"]
    rows = [("served by kv-offload (host + disk)", s["served_tokens"]),
            ("ideal LRU, disk budget", s["ideal_disk_tokens"]),
            ("ideal LRU, host budget", s["ideal_host_tokens"])]
    header = ("tokens from cache", "tokens", "% of prompt tokens", "x ideal disk")
    body = [(name, str(v), f"{100 * v / prompt:.1f}",
             f"{v / s['ideal_disk_tokens']:.2f}" if s["ideal_disk_tokens"] else "-")
            for name, v in rows]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *body]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    t = s["connector_totals"]
    print(f"\nconnector: hits planned from host {int(t.get('hit_tokens_host', 0))} / disk "
          f"{int(t.get('hit_tokens_disk', 0))} tokens; loads failed "
          f"{int(t.get('load_failed_jobs', 0))} ({int(t.get('load_failed_blocks', 0))} blocks, "
          f"{int(t.get('storage_read_failed_keys', 0))} disk reads failed); blocks stored "
          f"{int(t.get('store_blocks', 0))}, skipped for lack of host room "
          f"{int(t.get('store_skipped_blocks', 0))}; requests served less than the ideal disk "
          f"LRU {s['requests_short_of_ideal_disk']} ({s['tokens_short_of_ideal_disk']} tokens)")
    print(f"same greedy tokens as without the connector: {'yes' if s['same_tokens'] else 'NO'} "
          f"(largest top-5 logprob difference {s['max_logprob_diff']:.2g}); engines "
          f"{s['seconds']['with_connector']:.0f} s with, {s['seconds']['without']:.0f} s "
          f"without the connector; the engine waited {t.get('engine_wait_s', 0):.2f} s in all "
          f"for store copies ({int(t.get('engine_waits', 0))} steps)")
    print("\nvalid run" if s["valid"] else "\nINVALID run:\n  " + "\n  ".join(s["problems"]))


def run(args: argparse.Namespace) -> int:
    from kv_offload.testing.tiny_vocab import NUM_WORDS, SPECIAL_TOKENS

    words = range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + NUM_WORDS)
    documents = zipf_trace.make_documents(args.documents, args.min_blocks, args.max_blocks,
                                          BLOCK_SIZE, words, args.seed)
    trace = zipf_trace.make_trace(documents, args.requests, args.zipf, args.question_tokens,
                                  BLOCK_SIZE, words, args.seed + 1)
    rounds = zipf_trace.split_rounds(trace, args.round)
    model = _model_dir(args)
    block_bytes = kv_bytes_per_block(model)
    document_blocks = sum(len(d) for d in documents) // BLOCK_SIZE
    host_slots = int(document_blocks * args.host_fraction)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kv-offload-zipf-"))
    max_len = max(len(t.prompt) for t in trace) + args.max_tokens
    base = {"model": str(model), "dtype": DTYPE, "round": args.round, "max_tokens": args.max_tokens,
            "max_model_len": -(-max_len // BLOCK_SIZE) * BLOCK_SIZE,
            "rounds": [[list(t.prompt) for t in r] for r in rounds]}
    runs = []
    try:
        without = _run_child("no-connector", {**base, "kv_transfer_config": None}, work)
        for fraction in args.disk_fraction:
            disk_blocks = int(document_blocks * fraction)
            sizes = {"kv_bytes_per_block": block_bytes, "document_blocks": document_blocks,
                     "document_kv_bytes": document_blocks * block_bytes,
                     "disk_fraction": fraction, "disk_blocks": disk_blocks,
                     "fs_bytes_to_use": disk_blocks * file_bytes_per_block(block_bytes),
                     "host_slots": host_slots, "cpu_bytes_to_use": host_slots * block_bytes}
            disk_dir = work / "disk"
            shutil.rmtree(disk_dir, ignore_errors=True)  # every budget starts empty
            disk_dir.mkdir(parents=True)
            extra = {"cpu_bytes_to_use": sizes["cpu_bytes_to_use"],
                     "storage_tier": "filesystem",
                     "storage_options": {"root_dir": str(disk_dir),
                                         "bytes_to_use": sizes["fs_bytes_to_use"]}}
            transfer = {"kv_connector": "KVOffloadConnector",
                        "kv_connector_module_path": "kv_offload.vllm", "kv_role": "kv_both",
                        "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": extra}
            with_conn = _run_child("connector", {**base, "kv_transfer_config": transfer}, work)
            summary = _summarise(trace, rounds, sizes, with_conn, without)
            _print_table(summary, sizes, args)
            runs.append({
                "model": {"path": str(model), **MODEL_SIZES}, "block_size": BLOCK_SIZE,
                "trace": {k: getattr(args, k) for k in (
                    "documents", "min_blocks", "max_blocks", "requests", "zipf", "round",
                    "seed", "question_tokens", "max_tokens")},
                "num_rounds": len(rounds), "sizes": sizes, **summary})
    finally:
        if args.work_dir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        document = runs[0] if len(runs) == 1 else {"runs": runs}
        args.json.write_text(json.dumps(document, indent=2))
    if args.plot:
        zipf_hits(runs, args.plot, run_note())
    return 0 if all(r["valid"] for r in runs) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--documents", type=int, default=100, help="documents (default 100)")
    p.add_argument("--min-blocks", type=int, default=8, help="shortest document, in blocks")
    p.add_argument("--max-blocks", type=int, default=20, help="longest document, in blocks")
    p.add_argument("--requests", type=int, default=400, help="requests in the trace")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent (default 1.0)")
    p.add_argument("--round", type=int, default=8, help="most requests per round")
    p.add_argument("--question-tokens", type=int, default=16, help="question per request")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request")
    p.add_argument("--disk-fraction", type=float, nargs="+", default=[0.5],
                   help="disk budget as a fraction of the documents' blocks (default 0.5); "
                        "several: one engine with the connector per budget, the same trace "
                        "and engine without the connector (JSON: {\"runs\": [...]})")
    p.add_argument("--host-fraction", type=float, default=1 / 40,
                   help="host tier as a fraction of the documents' blocks (default 1/40: "
                        "smaller than the blocks of one round in flight)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, help="model to reuse or build "
                   "(default ~/.cache/kv-offload/bench-zipf-model-float32)")
    p.add_argument("--work-dir", type=Path, help="engine logs and the disk tier")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    p.add_argument("--json", type=Path, help="also write the results to this file")
    p.add_argument("--plot", type=plot_path, metavar="PATH",
                   help="also draw served tokens against the ideal LRU by disk budget in this "
                        "PNG (matplotlib; give several --disk-fraction values)")
    args = p.parse_args(argv)
    if args.child is not None:
        return _child(args.child)
    if args.question_tokens + args.max_tokens >= BLOCK_SIZE:
        p.error("--question-tokens + --max-tokens must stay below the block size "
                f"({BLOCK_SIZE}): only document blocks may fill")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
