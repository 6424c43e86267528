"""Concurrent load on vLLM's OpenAI-compatible server, with and without KVOffloadConnector.

    python benchmarks/bench_serving.py --json bench-serving.json
    python benchmarks/bench_serving.py --requests 40 --clients 8 --documents 2   # a quick look

The same workload runs against two servers started one after the other in this run (same
model, same engine settings, same vLLM cache size; `python -m vllm.entrypoints.openai.api_server`
on a free loopback port): one without a KV connector, one with KVOffloadConnector over a host
tier and a disk tier that are both too small for the workload, so both evict.

Workload: a few long shared documents (random words of the tiny-model vocabulary) and one
distinct question per request appended to a document (request i asks about document
i mod D). C client tasks (the official `openai` async client, streaming) take requests in
order until all R are done; when request R/2 is handed out, vLLM's own prefix cache is reset
(`POST /reset_prefix_cache?reset_running_requests=true`: running requests are preempted and
recomputed, so the reset happens under load; vLLM refuses it while a connector load is in
flight, so it is retried until it succeeds). vLLM's cache is also small, so documents fall
out of it during the run anyway.

Checked, and the exit code is non-zero otherwise: zero failed requests on both servers, every
completion's greedy tokens identical to the no-connector server's for the same request, both
servers healthy at the end, and a clean shutdown (no engine process left behind). Logprobs
are compared too, and reported: under concurrency the two servers batch differently, and a
prompt continued from a cache is a shorter prefill than a recomputed one, so the last bits
differ with or without a connector. The servers run in float32 for that reason: in bfloat16
these one-ulp differences (about 0.008 in a logprob) flip greedy tokens wherever the random
model's top two candidates tie within them (3 of 40 requests in a trial run, every flip at
such a tie; `--dtype bfloat16` shows it, `--control` measures the noise between two
servers without the connector).

Reported per server: time to first token (p50, p99; streamed, client-side), throughput
(requests/s, generated tokens/s), prompt tokens served from a cache, and for the connector
its hits by tier, failed blocks and stores from `/metrics`. Bounded: a per-request timeout,
a deadline for the whole load, loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kv_offload.serving.client import Completion, ServingClient, compare_outputs, stream_completion
from kv_offload.serving.server import ServerSettings, VllmServer
from kv_offload.tools.demo import model_dir

NUM_WORDS = 500  # the tiny models' vocabulary: "w0".."w499", one token each
_RESET_GIVE_UP_S = 60.0


@dataclass(frozen=True)
class RequestResult:
    index: int
    document: int
    completion: Completion | None
    error: str | None
    started_s: float  # since the load began


@dataclass(frozen=True)
class LoadRun:
    mode: str
    wall_s: float
    results: list[RequestResult]
    reset: str
    healthy_after: bool
    counters: dict[str, Any]
    """/metrics over the load: vLLM's own and connector hit tokens, the connector's counters."""
    shutdown_clean: bool
    shutdown: dict[str, Any]
    load_average: tuple[float, float]
    """1-minute load average of this machine before and after the load."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=32, help="concurrent client tasks")
    parser.add_argument("--documents", type=int, default=5)
    parser.add_argument("--document-tokens", type=int, default=1024)
    parser.add_argument("--question-tokens", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=16, help="generated per request")
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--model-size", choices=("tiny", "small"), default="small",
                        help="the demo's random-weight Llama-like model (default small)")
    parser.add_argument("--cache-dir", type=Path, help="where the model is built")
    # float32 KV of the small model: 256 KiB per 32-token block, 8 MiB per document.
    # Five documents (40 MiB) do not fit in vLLM's cache (24 MiB, running requests included),
    # nor, with every request's own blocks stored too, in the host (16) or disk (48) tier.
    parser.add_argument("--vllm-cache-mib", type=int, default=24,
                        help="vLLM's own KV cache (--kv-cache-memory-bytes), MiB")
    parser.add_argument("--host-tier-mib", type=int, default=16)
    parser.add_argument("--disk-tier-mib", type=int, default=48, help="0: no disk tier")
    parser.add_argument("--dtype", default="float32",
                        help="server dtype (default float32: see the module docstring)")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--deadline-s", type=float, default=900.0,
                        help="give up on the load of one server after this long")
    parser.add_argument("--work-dir", type=Path, help="server logs and the disk tier "
                        "(default: a temporary directory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--control", action="store_true",
                        help="also run a second server without the connector and compare it "
                             "with the first: how often greedy tokens differ between two "
                             "identical servers under this concurrency (the noise floor)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


def build_prompts(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(document index, prompt text) per request: a shared document, then a new question."""
    rng = random.Random(args.seed)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(NUM_WORDS)}" for _ in range(n))

    documents = [words(args.document_tokens) for _ in range(args.documents)]
    return [(i % args.documents, documents[i % args.documents] + " " + words(args.question_tokens))
            for i in range(args.requests)]


def transfer_config(disk_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    extra: dict[str, Any] = {"cpu_bytes_to_use": f"{args.host_tier_mib}MiB"}
    if args.disk_tier_mib:
        extra.update(storage_tier="filesystem", storage_options={
            "root_dir": str(disk_dir), "bytes_to_use": f"{args.disk_tier_mib}MiB"})
    return {
        "kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kv_offload.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


async def run_load(url: str, model: str, prompts: list[tuple[int, str]],
                   args: argparse.Namespace) -> tuple[list[RequestResult], float, str]:
    """All requests through `args.clients` concurrent tasks; vLLM's cache reset half-way."""
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0,
                                timeout=args.request_timeout_s)
    results: list[RequestResult | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))
    reset_at = len(prompts) // 2
    reset_outcome: list[str] = ["not reached"]
    began = time.perf_counter()

    async def reset() -> None:
        # With reset_running_requests vLLM preempts what runs, but refuses (HTTP 500, "running
        # requests waiting for remote KV transfer") while a connector load is in flight: retry.
        tries, first_try = 0, time.perf_counter()
        async with httpx.AsyncClient(timeout=60) as http:
            while True:
                tries += 1
                response = await http.post(f"{url}/reset_prefix_cache",
                                           params={"reset_running_requests": "true"})
                ok = response.status_code == 200 and response.json().get("success")
                if ok or time.perf_counter() - first_try > _RESET_GIVE_UP_S:
                    break
                await asyncio.sleep(0.1)
        reset_outcome[0] = (f"at request {reset_at}, t={first_try - began:.1f} s: "
                            f"{'success' if ok else 'FAILED'} after {tries} attempt(s) in "
                            f"{time.perf_counter() - first_try:.1f} s")

    async def worker() -> None:
        for i in next_index:  # one shared iterator: each request is taken exactly once
            if i == reset_at:
                await reset()
            document, prompt = prompts[i]
            started = time.perf_counter() - began
            try:
                completion = await stream_completion(
                    client, model, prompt, max_tokens=args.max_tokens, logprobs=args.logprobs)
                results[i] = RequestResult(i, document, completion, None, started)
            except Exception as e:  # counted and reported: the load must go on
                results[i] = RequestResult(i, document, None, f"{type(e).__name__}: {e}",
                                           started)

    tasks = [asyncio.create_task(worker()) for _ in range(args.clients)]
    _, pending = await asyncio.wait(tasks, timeout=args.deadline_s)
    for task in pending:
        task.cancel()
    await client.close()
    wall_s = time.perf_counter() - began
    return [r or RequestResult(i, prompts[i][0], None, "not finished before the deadline", 0.0)
            for i, r in enumerate(results)], wall_s, reset_outcome[0]


def run_server(mode: str, settings: ServerSettings, prompts: list[tuple[int, str]],
               args: argparse.Namespace, work: Path) -> LoadRun:
    print(f"[{mode}] starting the server (log {work / mode}.log) ...", flush=True)
    with VllmServer(settings, work, name=mode) as server:
        with ServingClient(server.url) as client:
            model = client.model
            # One long unrelated request first: the engine's first-call costs stay out of the
            # measurement (and on some CPUs a very short first prompt crashes vLLM's worker).
            client.complete(build_warmup(args), max_tokens=2, logprobs=1)
            print(f"[{mode}] {len(prompts)} requests from {args.clients} clients ...",
                  flush=True)
            before, load_before = client.metrics(), os.getloadavg()[0]
            results, wall_s, reset = asyncio.run(run_load(server.url, model, prompts, args))
            load_after = os.getloadavg()[0]
            healthy = client.health()
            time.sleep(1.0)  # the last steps' stats reach /metrics
            after = client.metrics()
        report = server.stop()
    counters = {"local_hit_tokens": after.local_hit_tokens - before.local_hit_tokens,
                "external_hit_tokens": after.external_hit_tokens - before.external_hit_tokens,
                "offload": None}
    if after.offload is not None:
        delta = after.offload.since(before.offload)
        counters["offload"] = {**asdict(delta), "hit_tokens": delta.hit_tokens}
        counters["loaded_blocks"] = delta.loaded_bytes / page_bytes(settings)
    return LoadRun(mode, wall_s, results, reset, healthy, counters, report.clean,
                   asdict(report), (load_before, load_after))


def page_bytes(settings: ServerSettings) -> int:
    """KV bytes of one engine block of the served Llama-like model."""
    config = json.loads((Path(settings.model) / "config.json").read_text())
    head = config["hidden_size"] // config["num_attention_heads"]
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[settings.dtype]
    return (config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head
            * settings.block_size * dtype_bytes)


def build_warmup(args: argparse.Namespace) -> str:
    rng = random.Random(args.seed + 1)
    return " ".join(f"w{rng.randrange(NUM_WORDS)}" for _ in range(args.document_tokens))


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarise(run: LoadRun) -> dict[str, Any]:
    done = [r.completion for r in run.results if r.completion is not None]
    ttft = [c.first_token_s for c in done if c.first_token_s is not None]
    prompt_tokens = sum(c.prompt_tokens for c in done)
    cached = sum(c.cached_tokens or 0 for c in done)
    return {
        "mode": run.mode, "requests": len(run.results), "completed": len(done),
        "errors": len(run.results) - len(done), "wall_s": run.wall_s,
        "requests_per_s": len(done) / run.wall_s,
        "output_tokens_per_s": sum(len(c.tokens) for c in done) / run.wall_s,
        "ttft_p50_s": percentile(ttft, 50) if ttft else None,
        "ttft_p99_s": percentile(ttft, 99) if ttft else None,
        "prompt_tokens": prompt_tokens, "cached_tokens": cached,
        "reset": run.reset, "healthy_after": run.healthy_after,
        "shutdown_clean": run.shutdown_clean, "load_average": run.load_average,
        **run.counters,
    }


def compare_runs(baseline: LoadRun, offload: LoadRun) -> dict[str, Any]:
    same_tokens, worst, mismatches = 0, 0.0, []
    for ref, got in zip(baseline.results, offload.results):
        if ref.completion is None or got.completion is None:
            continue
        diff = compare_outputs(ref.completion, got.completion)
        worst = max(worst, diff.max_logprob_diff)
        if diff.same_tokens:
            same_tokens += 1
        else:
            at = diff.first_difference
            mismatches.append({
                "request": ref.index, "first_difference": at,
                "logprob_diff_up_to_there": diff.max_logprob_diff,
                "reference_top": _step(ref.completion, at), "top": _step(got.completion, at)})
    return {"same_tokens": same_tokens, "compared": len(baseline.results),
            "max_logprob_diff": worst, "mismatches": mismatches}


def _step(completion: Completion, at: int) -> dict[str, float]:
    return completion.top_logprobs[at] if at < len(completion.top_logprobs) else {}


def print_table(rows: list[dict[str, Any]], comparison: dict[str, Any],
                args: argparse.Namespace) -> None:
    print(f"\n{args.requests} requests, {args.clients} concurrent clients, {args.documents} "
          f"documents x {args.document_tokens} tokens + {args.question_tokens}-token questions, "
          f"{args.max_tokens} tokens generated; vLLM cache {args.vllm_cache_mib} MiB, host tier "
          f"{args.host_tier_mib} MiB, disk tier {args.disk_tier_mib} MiB\n")
    header = ("server", "errors", "wall s", "req/s", "gen tok/s", "TTFT p50", "TTFT p99",
              "cached tokens", "kv-offload hits host/disk", "failed blocks")
    lines = [header]
    for r in rows:
        off = r["offload"]
        hits = "-" if off is None else \
            f"{off['hit_tokens_host']:.0f} / {off['hit_tokens_storage']:.0f}"
        failed = "-" if off is None else \
            f"{off['failed_load_blocks'] + off['failed_store_blocks']:.0f}"
        lines.append((r["mode"], str(r["errors"]), f"{r['wall_s']:.1f}",
                      f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.0f}",
                      _ms(r["ttft_p50_s"]), _ms(r["ttft_p99_s"]),
                      f"{r['cached_tokens']} / {r['prompt_tokens']}", hits, failed))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for n, line in enumerate(lines):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    base, off = rows
    print(f"\nkv-offload / no connector: TTFT p50 x{off['ttft_p50_s'] / base['ttft_p50_s']:.2f}, "
          f"p99 x{off['ttft_p99_s'] / base['ttft_p99_s']:.2f}, throughput "
          f"x{off['requests_per_s'] / base['requests_per_s']:.2f}")
    print(f"same greedy tokens as the no-connector server: {comparison['same_tokens']}/"
          f"{comparison['compared']} (max |logprob diff| {comparison['max_logprob_diff']:.3g})")
    for r in rows:
        off = r["offload"]
        line = (f"[{r['mode']}] clients saw {r['cached_tokens']} cached prompt tokens; vLLM "
                f"counted {r['local_hit_tokens']:.0f} from its own cache + "
                f"{r['external_hit_tokens']:.0f} from a connector")
        if off is not None:
            line += (f"; kv-offload counted {off['hit_tokens']:.0f} hit tokens ("
                     f"{off['hit_tokens'] / 32:.0f} blocks) and loaded {r['loaded_blocks']:.0f}"
                     f" blocks, {off['failed_load_blocks']:.0f} of them failed (recomputed)")
        print(line)
    for r in rows:
        print(f"[{r['mode']}] cache reset {r['reset']}; healthy after: "
              f"{'yes' if r['healthy_after'] else 'NO'}; clean shutdown: "
              f"{'yes' if r['shutdown_clean'] else 'NO'}")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = build_prompts(args)
    model = str(model_dir(args.model_size, args.cache_dir))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kv-offload-bench-serving-"))
    max_len = -(-(args.document_tokens + args.question_tokens + args.max_tokens + 1) // 32) * 32
    common = dict(model=model, max_model_len=max_len, max_num_seqs=args.clients,
                  kv_cache_memory_bytes=args.vllm_cache_mib << 20, dtype=args.dtype)
    baseline = run_server("no connector", ServerSettings(**common), prompts, args, work)
    disk = work / "kv-disk"
    disk.mkdir(parents=True, exist_ok=True)
    offload = run_server("kv-offload", ServerSettings(
        **common, kv_transfer_config=transfer_config(disk, args)), prompts, args, work)
    rows = [summarise(baseline), summarise(offload)]
    comparison = compare_runs(baseline, offload)
    control = None
    if args.control:
        control_run = run_server("no connector (control)", ServerSettings(**common), prompts,
                                 args, work)
        control = compare_runs(baseline, control_run)
    print_table(rows, comparison, args)
    if control is not None:
        print(f"control: a second server without the connector has the same greedy tokens "
              f"as the first for {control['same_tokens']}/{control['compared']} requests")
    problems = [f"{r['mode']}: {r['errors']} failed requests" for r in rows if r["errors"]]
    problems += [f"{r['mode']}: unhealthy after the load" for r in rows if not r["healthy_after"]]
    problems += [f"{r['mode']}: unclean shutdown" for r in rows if not r["shutdown_clean"]]
    problems += [f"{r['mode']}: vLLM's cache was not reset" for r in rows
                 if "success" not in r["reset"]]
    if comparison["same_tokens"] != comparison["compared"]:
        problems.append(f"{len(comparison['mismatches'])} completions differ from the "
                        f"no-connector server's")
    if args.json:
        args.json.write_text(json.dumps({
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": model, "summary": rows, "comparison": comparison, "control": control,
            "problems": problems,
            "requests": {run.mode: [_request_json(r) for r in run.results]
                         for run in (baseline, offload)},
        }, indent=1))
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    for run in (baseline, offload):
        errors = [r.error for r in run.results if r.error]
        if errors:
            print(f"[{run.mode}] first error: {errors[0]}", file=sys.stderr)
    return 1 if problems else 0


def _request_json(result: RequestResult) -> dict[str, Any]:
    c = result.completion
    return {"index": result.index, "document": result.document, "error": result.error,
            "started_s": result.started_s,
            "ttft_s": None if c is None else c.first_token_s,
            "seconds": None if c is None else c.seconds,
            "cached_tokens": None if c is None else c.cached_tokens,
            "tokens": None if c is None else list(c.tokens)}


if __name__ == "__main__":
    sys.exit(main())
