"""Generation throughput of the real vLLM CPU engine over an empty vs a full disk directory.

    python benchmarks/bench_full_directory.py --json full-dir.json
    python benchmarks/bench_full_directory.py --before /tmp/before --json full-dir.json

An operator restarting a node with a full cache starts the engine over a directory that
already holds hundreds of thousands of block files. This runs the real vLLM CPU engine
(in-process engine core, a random-weight Llama-like model built by
`kv_offload.testing.tiny_models`, KVOffloadConnector with a host tier and `fs_root_dir`)
twice per tree, each in its own child process:

  empty  over an empty `fs_root_dir`;
  full   over a `fs_root_dir` pre-filled with `--files` files (default 300k), in thirds:
         files named as our keys in our own layout directory but holding garbage (corrupt,
         adopted by the inventory, a miss if ever read), foreign files (other names) in our
         fan-out directories, and block files of another layout directory with no heartbeat
         and day-old mtimes (a crashed engine of another model: stale, counted against the
         budget, not evicted while the root is within it).

Each engine runs `--rounds` rounds after a warm-up; a round generates `--max-tokens` tokens
for each of `--prompts` new prompts (distinct in every round and engine, so nothing is a
cache hit) in one `generate` call; its throughput is generated tokens / wall time. The disk
tier rescans at its default interval (5 s), so each round spans several rescans. Reported:
the median of the rounds per engine, and full / empty per tree (goal >= 0.85); beside it the
best round of each (the least disturbed by other load on a shared host). With
`--before DIR` (a directory holding another tree's `kv_offload` package, e.g.
`git archive <rev> kv_offload | tar -x -C DIR`) the same two engines also run that tree, in
the same run, interleaved (empty now, full now, full before, empty before), so both trees see
the same machine. `--profile DIR` runs every engine under `py-spy record` (raw collapsed
stacks, `DIR/<engine>.txt`) and prints the share of samples in the tier's scan functions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
CONNECTOR_EXTRA = {"cpu_bytes_to_use": "1GiB", "fs_bytes_to_use": "16GiB"}
GOAL = 0.85
SCAN_FUNCTIONS = ("scan_layout_dir", "survey_root", "merge_scan", "merge_changes",
                  "_files_under", "FanoutScanner", "_relist", "totals", "rescan")


# ----------------------------------------------------------------------------- child side

def _child(spec_path: Path) -> int:
    from vllm import LLM, SamplingParams

    from kv_offload.testing.tiny_vocab import word_prompt

    spec = json.loads(spec_path.read_text())
    started = time.perf_counter()
    llm = LLM(model=spec["model"], block_size=BLOCK_SIZE, max_model_len=2048,
              kv_cache_memory_bytes=256 * 1024 * 1024, enable_prefix_caching=True,
              enforce_eager=True, dtype="bfloat16", seed=0, max_num_seqs=spec["prompts"],
              kv_transfer_config=spec["kv_transfer_config"])
    engine_start_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    offset = spec["prompt_offset"]

    def batch(round_index: int) -> list[str]:
        return [word_prompt(spec["prompt_tokens"], offset=offset + 1000 * round_index + i)
                for i in range(spec["prompts"])]

    llm.generate(batch(0), params, use_tqdm=False)  # warm-up: first-call costs
    rounds = []
    for r in range(1, spec["rounds"] + 1):
        prompts = batch(r)
        t0, cpu0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rounds.append({"round": r, "wall_s": wall_s, "tokens": tokens,
                       "tokens_per_s": tokens / wall_s,
                       "process_cpu_s": time.process_time() - cpu0})
    Path(spec["result_path"]).write_text(json.dumps(
        {"engine_start_s": engine_start_s, "rounds": rounds}))
    del llm
    return 0


# ---------------------------------------------------------------------------- parent side

def _fill(root: Path, layout_name: str, files: int, seed: int = 0) -> dict[str, int]:
    """Pre-fill ``root`` with ``files`` files in thirds (see the module docstring)."""
    import random

    import xxhash

    rng = random.Random(seed)
    ours = root / layout_name
    other = root / "kv-v1-00000000deadbeef"
    day_ago = time.time() - 86400
    counts = {"corrupt_ours": 0, "foreign_in_ours": 0, "other_layout": 0}
    garbage = b"\x00not a kv-offload record\x00".ljust(64, b"#")
    for i in range(files):
        key = rng.randbytes(32)
        fanout = xxhash.xxh3_64_hexdigest(key)[:2]
        kind = ("corrupt_ours", "foreign_in_ours", "other_layout")[i % 3]
        if kind == "corrupt_ours":
            path = ours / fanout / f"{key.hex()}.safetensors"
        elif kind == "foreign_in_ours":
            path = ours / fanout / f"left-by-someone-{i}.dat"
        else:
            path = other / fanout / f"{key.hex()}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, garbage)
        os.close(fd)
        if kind == "other_layout":
            os.utime(path, (day_ago, day_ago))
        counts[kind] += 1
    return counts


def _transfer_config(root: Path) -> dict[str, Any]:
    return {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kv_offload.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {**CONNECTOR_EXTRA, "fs_root_dir": str(root)}}


def _run_engine(name: str, tree: Path, root: Path, spec: dict[str, Any], work: Path,
                profile: Path | None) -> dict[str, Any]:
    run_dir = work / name
    run_dir.mkdir(parents=True)
    spec_path, result_path, log_path = run_dir / "spec.json", run_dir / "result.json", \
        run_dir / "engine.log"
    spec_path.write_text(json.dumps({**spec, "result_path": str(result_path),
                                     "kv_transfer_config": _transfer_config(root)}))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)]
    if profile is not None:
        cmd = ["py-spy", "record", "-r", "50", "-f", "raw", "--threads", "-o",
               str(profile / f"{name}.txt"), "--", *cmd]
    print(f"  engine '{name}' ({tree}) over {root} (log {log_path}) ...", flush=True)
    load_before = os.getloadavg()[0]
    with log_path.open("w") as log:
        proc = subprocess.run(cmd, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"engine '{name}' failed (exit {proc.returncode}):\n"
                           f"{log_path.read_text()[-3000:]}")
    result = json.loads(result_path.read_text())
    result["median_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in result["rounds"])
    result["best_tokens_per_s"] = max(r["tokens_per_s"] for r in result["rounds"])
    result["load_average_before_after"] = [load_before, os.getloadavg()[0]]
    if profile is not None:
        result["profile"] = _profile_shares(profile / f"{name}.txt")
    return result


def _profile_shares(path: Path) -> dict[str, float]:
    """Share of all samples whose stack contains each scan function (py-spy raw format:
    ``frame;frame;... count`` per line)."""
    total, hits = 0, dict.fromkeys(SCAN_FUNCTIONS, 0)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        for fn in SCAN_FUNCTIONS:
            if f"{fn} (" in stack:
                hits[fn] += int(count)
    return {fn: n / total for fn, n in hits.items() if n} if total else {}


def _layout_name(root: Path) -> str:
    names = [p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("kv-v")]
    if len(names) != 1:
        raise RuntimeError(f"expected one layout directory in {root}, found {names}")
    return names[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--files", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--before", type=Path, help="a directory holding another tree's "
                        "kv_offload package, run side by side")
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--profile", type=Path, help="py-spy every engine into this folder")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child)

    from kv_offload.tools.demo import model_dir

    now_tree = Path(__file__).resolve().parent.parent
    model = model_dir("small")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kv-offload-fulldir-"))
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    spec = {"model": str(model), "rounds": args.rounds, "prompts": args.prompts,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens}
    trees = [("now", now_tree)] + ([("before", args.before.resolve())] if args.before else [])
    order = [("now", "empty"), ("now", "full")]
    if args.before:
        order += [("before", "full"), ("before", "empty")]
    full_root = work / "root-full"
    results: dict[str, dict[str, Any]] = {}
    fill: dict[str, Any] = {}
    for i, (tree_name, kind) in enumerate(order):
        root = work / (f"root-empty-{tree_name}" if kind == "empty" else "root-full")
        if kind == "full" and not fill:
            layout = _layout_name(work / "root-empty-now")  # (same model: same layout)
            t0 = time.perf_counter()
            print(f"  filling {full_root} with {args.files} files ...", flush=True)
            fill = {**_fill(full_root, layout, args.files),
                    "seconds": time.perf_counter() - t0}
        name = f"{kind}-{tree_name}"
        results[name] = _run_engine(name, dict(trees)[tree_name], root,
                                    {**spec, "prompt_offset": 100_000 * (i + 1)}, work,
                                    args.profile)

    from kv_offload.tools.report import Table, emit, envelope

    table = Table(f"Generation throughput, real vLLM CPU engine, {args.files} files "
                  f"pre-filled (median of {args.rounds} rounds)",
                  ["tree", "empty dir tok/s", "full dir tok/s", "full / empty", "best: empty",
                   "full", "full / empty", "goal"])
    summary = {}
    for tree_name, _ in trees:
        empty = results[f"empty-{tree_name}"]["median_tokens_per_s"]
        full = results[f"full-{tree_name}"]["median_tokens_per_s"]
        best_empty = results[f"empty-{tree_name}"]["best_tokens_per_s"]
        best_full = results[f"full-{tree_name}"]["best_tokens_per_s"]
        summary[tree_name] = {"empty_tokens_per_s": empty, "full_tokens_per_s": full,
                              "ratio": full / empty, "best_ratio": best_full / best_empty}
        table.add(tree_name, f"{empty:.1f}", f"{full:.1f}", f"{full / empty:.2f}",
                  f"{best_empty:.1f}", f"{best_full:.1f}", f"{best_full / best_empty:.2f}",
                  f">= {GOAL}")
    table.notes.append("engine start (s): " + ", ".join(
        f"{k} {v['engine_start_s']:.1f}" for k, v in results.items()))
    table.notes.append("1-min load average before/after: " + ", ".join(
        f"{k} {a:.1f}/{b:.1f}" for k, (a, b) in
        ((k, v["load_average_before_after"]) for k, v in results.items())))
    for k, v in results.items():
        if v.get("profile"):
            table.notes.append(f"py-spy {k}: " + ", ".join(
                f"{fn} {share:.1%}" for fn, share in sorted(v["profile"].items())))
    emit([table], envelope("bench_full_directory", {
        "args": {k: str(v) for k, v in vars(args).items()}, "fill": fill, "summary": summary,
        "engines": results}, "median"), args.json)
    return 0 if all(s["ratio"] >= GOAL for k, s in summary.items() if k == "now") else 1


if __name__ == "__main__":
    sys.exit(main())
