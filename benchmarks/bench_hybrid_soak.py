"""Tier hits under eviction, plain attention against a sliding-window hybrid (vLLM CPU engine).

    python benchmarks/bench_hybrid_soak.py --json /tmp/soak.json [--model llama gemma3]

The scenario an operator with too little cache runs (issue 50): 8 documents of 700 tokens,
requested with Zipf-like weights (1/k), each followed by a random tail of 10-60 tokens;
rounds of 12 requests sent in one `generate` call; vLLM's own prefix cache dropped after every
round (`reset_prefix_cache`), so later hits come from our tiers; 4 rounds, then a new engine
process over the same disk directory and a fifth round. Host tier 4 MiB and disk tier 8 MiB
(both evict all the time), block size 32, bfloat16, 6 layers, greedy, 8 tokens per request.
Two models of the same size: Llama-like (6 full-attention layers: one KV-cache group) and
Gemma3-like (two sliding-window layers, window 128, per full-attention layer: vLLM makes three
groups of two layers, one full and two sliding).

Reported per model (hits are vLLM's own `num_cached_tokens` per request):
- tier hits: cached tokens in rounds 2-5 beyond what the engine without the connector gets
  for the same request (within a round vLLM's own cache serves repeated documents);
- the goal, 20% of the prompt tokens of rounds 2-5;
- ideal: the same trace replayed offline through the best cache of the disk tier's size. Each
  document is a servable unit: its whole blocks (full attention: all of them; a sliding-window
  group: the last ceil((window - 1) / block) blocks before the hit point), at the size of one
  block file each (data plus its aligned header); the disk budget holds that many whole units
  (the room left over holds nothing: a partial prefix could add a little). At every round's
  end the cache keeps the units that serve the most tier hits over the whole trace (exact,
  `ideal_cached`), choosing only among what it held or what that round computed. Its tier
  hits are counted like the engine's. Reported: tier hits / ideal;
- whether every request generated the same tokens as the engine without the connector (a
  request that first differs at a near-tie, both runs' top two tokens within 0.05 in
  logprob, is counted apart: in bfloat16 a different batch flips such picks), and the
  largest top-5 logprob difference before the first differing token.

The benchmark imports nothing of kv-offload in the engine processes beyond the connector
(`kv_connector_module_path`), so it runs against any tree on PYTHONPATH (`--tree`): that is
how issue 50's drop was bisected.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
DOCUMENTS, DOCUMENT_TOKENS, TAIL_TOKENS = 8, 700, (10, 60)
ROUNDS, ROUND_REQUESTS, RESTART_BEFORE_ROUND = 5, 12, 4  # (0-based: the fifth round)
HOST_BYTES, DISK_BYTES = 4 << 20, 8 << 20
MAX_TOKENS = 8
GOAL_FRACTION = 0.20
LAYERS, WINDOW, FULL_EVERY = 6, 128, 3
SIZES = {"hidden": 256, "heads": 4, "kv_heads": 2}
HEAD_DIM = SIZES["hidden"] // SIZES["heads"]
MODELS = ("llama", "gemma3")
RESULT_MARKER = "SOAK_RESULT "


# ----------------------------------------------------------------------------- the trace

@dataclass(frozen=True)
class Request:
    round: int
    document: int
    prompt: tuple[int, ...]


def make_trace(seed: int) -> list[Request]:
    """Seeded: documents of random word tokens, Zipf-like picks, random tails."""
    from kv_offload.testing.tiny_vocab import NUM_WORDS, SPECIAL_TOKENS

    words = range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + NUM_WORDS)
    rng = random.Random(seed)
    docs = [tuple(rng.choice(words) for _ in range(DOCUMENT_TOKENS)) for _ in range(DOCUMENTS)]
    weights = [1 / k for k in range(1, DOCUMENTS + 1)]
    trace = []
    for r in range(ROUNDS):
        for d in rng.choices(range(DOCUMENTS), weights=weights, k=ROUND_REQUESTS):
            tail = tuple(rng.choice(words) for _ in range(rng.randint(*TAIL_TOKENS)))
            trace.append(Request(r, d, docs[d] + tail))
    return trace


# ----------------------------------------------------------------------------- the ideal

@dataclass(frozen=True)
class Geometry:
    """Keys per block of the model: its full-attention and sliding-window groups."""

    full_groups: int
    window_groups: int
    window_blocks: int  # blocks a sliding-window group needs before the hit point
    key_file_bytes: int  # one key's block file on disk (data plus aligned header)

    def keys_for(self, blocks: int) -> int:
        """Keys that serve a hit of `blocks` blocks."""
        return blocks * self.full_groups + min(blocks, self.window_blocks) * self.window_groups


def geometry(model: str) -> Geometry:
    from kv_offload.backends.filesystem.fileformat import data_offset

    per_layer = BLOCK_SIZE * SIZES["kv_heads"] * HEAD_DIM * 2 * 2  # K and V, bfloat16
    if model == "llama":
        layers_per_group, full, window = LAYERS, 1, 0
    else:  # vLLM groups hybrid layers by the smaller count: one full, two sliding groups
        full_layers = LAYERS // FULL_EVERY
        layers_per_group, full, window = full_layers, 1, (LAYERS - full_layers) // full_layers
    data = per_layer * layers_per_group
    key = bytes(8 + 2 + 32)  # generation, group, a 32-byte block hash
    return Geometry(full, window, math.ceil((WINDOW - 1) / BLOCK_SIZE),
                    data_offset(key, "0" * 16, data) + data)


def ideal_cached(trace: list[Request], without: list[int], capacity_units: int,
                 unit_tokens: int) -> list[int]:
    """Tokens the offline best cache serves each request: at every round's end it keeps
    at most `capacity_units` whole documents among those it held or that round computed,
    chosen to serve the most tier hits over the whole trace (a request's tier hit: what
    the cache serves it beyond `without[i]`, the engine's own cache without the connector).
    Exact, by dynamic programming over the sets of documents held (8 documents: 256)."""
    rounds = sorted({q.round for q in trace})
    gain: dict[tuple[int, int], int] = {}  # (round, document) -> tier hits if held
    for q, own in zip(trace, without):
        hit = min(unit_tokens, (len(q.prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE)
        gain[q.round, q.document] = gain.get((q.round, q.document), 0) + max(0, hit - own)
    best: dict[frozenset[int], tuple[int, list[frozenset[int]]]] = {frozenset(): (0, [])}
    for r in rounds:
        computed = {q.document for q in trace if q.round == r}
        after: dict[frozenset[int], tuple[int, list[frozenset[int]]]] = {}
        for held, (value, path) in best.items():
            value += sum(gain.get((r, d), 0) for d in held)
            pool = sorted(held | computed)
            for k in range(min(capacity_units, len(pool)) + 1):
                for keep in itertools.combinations(pool, k):
                    state = frozenset(keep)
                    if state not in after or after[state][0] < value:
                        after[state] = (value, [*path, held])
        best = after
    _, path = max(best.values(), key=lambda entry: entry[0])
    held_before = dict(zip(rounds, path))
    return [min(unit_tokens, (len(q.prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE)
            if q.document in held_before[q.round] else 0 for q in trace]


# ------------------------------------------------------------------------ engine processes

def _child(spec_path: Path) -> int:
    """One engine process: its rounds, then one RESULT_MARKER line of JSON on stdout."""
    from vllm import LLM, SamplingParams

    spec = json.loads(spec_path.read_text())
    llm = LLM(model=spec["model"], block_size=BLOCK_SIZE, max_model_len=1024,
              kv_cache_memory_bytes=128 << 20, enable_prefix_caching=True, enforce_eager=True,
              dtype="bfloat16", seed=0, max_num_seqs=ROUND_REQUESTS,
              kv_transfer_config=spec["kv_transfer_config"])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=5)
    out = []
    for i, prompts in enumerate(spec["rounds"]):
        if i and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                              use_tqdm=False):
            out.append({"cached": o.num_cached_tokens or 0,
                        "tokens": list(o.outputs[0].token_ids),
                        "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                                     for step in (o.outputs[0].logprobs or [])]})
    print(RESULT_MARKER + json.dumps(out), flush=True)
    del llm  # the connector's shutdown flushes pending disk writes
    return 0


def _engine(name: str, model: Path, rounds: list[list[Request]], transfer: dict | None,
            work: Path, tree: Path | None) -> list[dict[str, Any]]:
    spec_path, log_path = work / f"{name}.json", work / f"{name}.log"
    spec_path.write_text(json.dumps({"model": str(model), "kv_transfer_config": transfer,
                                     "rounds": [[list(q.prompt) for q in r] for r in rounds]}))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if tree is not None:
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{env.get('PYTHONPATH', '')}"
    with log_path.open("w") as log:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                               str(spec_path)], cwd=work, env=env, stdout=subprocess.PIPE,
                              stderr=log, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"engine {name} failed ({proc.returncode}); see {log_path}:\n"
                           f"{log_path.read_text()[-3000:]}")
    return json.loads(lines[-1][len(RESULT_MARKER):])


def _model_dir(model: str, cache: Path) -> Path:
    path = cache / f"soak-{model}-{LAYERS}l-{SIZES['hidden']}"
    if (path / "config.json").exists():
        return path
    from kv_offload.testing import tiny_models

    building = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=cache))
    if model == "llama":
        tiny_models.build_llama(building, layers=LAYERS, max_positions=1024, **SIZES)
    else:
        tiny_models.build_gemma3(building, layers=LAYERS, full_attention_every=FULL_EVERY,
                                 sliding_window=WINDOW, head_dim=HEAD_DIM, max_positions=1024,
                                 **SIZES)
    building.rename(path)
    return path


TIE_LOGPROB = 0.05  # bfloat16 logits of a random-weight model: about 2**-8 relative


def _near_tie(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two outputs first differ where both runs' top two tokens were within
    TIE_LOGPROB of each other: in bfloat16 a different batch (the connector delays requests
    whose load is in flight) can flip such a pick with no byte of KV different. Anything
    else is a real difference."""
    step = next(i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y)
    picked = (str(a["tokens"][step]), str(b["tokens"][step]))
    for run in (a, b):
        top = run["logprobs"][step]
        if not all(t in top for t in picked) or abs(top[picked[0]] - top[picked[1]]) \
                > TIE_LOGPROB:
            return False
    return True


def _logprob_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    worst = 0.0
    for step, (x, y) in enumerate(zip(a["logprobs"], b["logprobs"])):
        worst = max([worst, *(abs(v - y[t]) for t, v in x.items() if t in y)])
        if a["tokens"][step] != b["tokens"][step]:
            break
    return worst


def run_model(model: str, trace: list[Request], work: Path, cache: Path,
              tree: Path | None) -> dict[str, Any]:
    path = _model_dir(model, cache)
    disk = work / f"{model}-disk"
    shutil.rmtree(disk, ignore_errors=True)
    disk.mkdir(parents=True)
    transfer = {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kv_offload.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"cpu_bytes_to_use": HOST_BYTES,
                                              "storage_tier": "filesystem",
                                              "storage_options": {"root_dir": str(disk),
                                                                  "bytes_to_use": DISK_BYTES}}}
    rounds = [[q for q in trace if q.round == r] for r in range(ROUNDS)]
    t0 = time.perf_counter()
    without = _engine(f"{model}-without", path, rounds, None, work, tree)
    first = _engine(f"{model}-with-1", path, rounds[:RESTART_BEFORE_ROUND], transfer, work, tree)
    second = _engine(f"{model}-with-2", path, rounds[RESTART_BEFORE_ROUND:], transfer, work, tree)
    with_conn = first + second
    geo = geometry(model)
    doc_blocks = DOCUMENT_TOKENS // BLOCK_SIZE
    units = DISK_BYTES // geo.key_file_bytes // geo.keys_for(doc_blocks)
    ideal = ideal_cached(trace, [x["cached"] for x in without], units, doc_blocks * BLOCK_SIZE)
    later = [i for i, q in enumerate(trace) if q.round > 0]
    tier = [max(0, with_conn[i]["cached"] - without[i]["cached"]) for i in later]
    ideal_tier = [max(0, ideal[i] - without[i]["cached"]) for i in later]
    later_prompt = sum(len(trace[i].prompt) for i in later)
    differ = [i for i, (a, b) in enumerate(zip(with_conn, without))
              if a["tokens"] != b["tokens"]]
    ties = [i for i in differ if _near_tie(with_conn[i], without[i])]
    mismatched = [i for i in differ if i not in ties]
    per_round = [sum(t for t, i in zip(tier, later) if trace[i].round == r)
                 for r in range(1, ROUNDS)]
    return {
        "model": model, "tier_hits": sum(tier), "ideal_tier_hits": sum(ideal_tier),
        "fraction_of_ideal": sum(tier) / sum(ideal_tier) if sum(ideal_tier) else None,
        "later_prompt_tokens": later_prompt, "goal": math.ceil(GOAL_FRACTION * later_prompt),
        "tier_hits_by_round": per_round, "same_tokens": not mismatched,
        "mismatched_requests": mismatched, "near_tie_requests": ties,
        "max_logprob_diff": max(_logprob_gap(a, b) for a, b in zip(with_conn, without)),
        "cached_with": [x["cached"] for x in with_conn],
        "cached_without": [x["cached"] for x in without], "ideal_cached": ideal,
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--model", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tree", type=Path, help="a kv-offload checkout to put first on the "
                   "engines' PYTHONPATH (default: the installed one)")
    p.add_argument("--model-cache", type=Path,
                   default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                   / "kv-offload")
    p.add_argument("--work-dir", type=Path, help="engine logs and disk tiers (kept)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.child is not None:
        return _child(args.child)
    args.model_cache.mkdir(parents=True, exist_ok=True)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kv-offload-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    trace = make_trace(args.seed)
    results = [run_model(m, trace, work, args.model_cache, args.tree) for m in args.model]
    header = ("model", "tier hits", "ideal", "x ideal", "goal", "by round 2-5", "same tokens",
              "logprob diff", "s")
    rows = [(r["model"], str(r["tier_hits"]), str(r["ideal_tier_hits"]),
             f"{r['fraction_of_ideal']:.2f}" if r["fraction_of_ideal"] is not None else "-",
             str(r["goal"]), " ".join(map(str, r["tier_hits_by_round"])),
             (f"NO {r['mismatched_requests'][:6]}" if not r["same_tokens"] else
              f"yes ({len(r['near_tie_requests'])} near-tie)" if r["near_tie_requests"]
              else "yes"),
             f"{r['max_logprob_diff']:.2g}", f"{r['wall_s']:.0f}") for r in results]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print(f"\n{DOCUMENTS} documents x {DOCUMENT_TOKENS} tokens, {ROUNDS} rounds of "
          f"{ROUND_REQUESTS} (restart before round {RESTART_BEFORE_ROUND + 1}), host "
          f"{HOST_BYTES >> 20} MiB, disk {DISK_BYTES >> 20} MiB, seed {args.seed}")
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "results": results}, indent=1))
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
