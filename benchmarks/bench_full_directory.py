"""Generation throughput of the real vLLM CPU engine over an empty vs a full disk directory.

    python benchmarks/bench_full_directory.py --json full-dir.json
    python benchmarks/bench_full_directory.py --before /tmp/before --json full-dir.json

An operator restarting a node with a full cache starts the engine over a directory that
already holds hundreds of thousands of block files. This runs the real vLLM CPU engine
(in-process engine core, a random-weight Llama-like model built by
`kv_offload.testing.tiny_models`, KVOffloadConnector with a host tier and the disk tier)
twice per tree, each in its own child process:

  empty  over an empty disk-tier directory;
  full   over a disk-tier directory pre-filled with `--files` files (default 300k), in thirds:
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
the same run. All engines are started first, then run their rounds in turns (round r of
every engine, in a rotating order, before round r+1 of any): the engines not measured are
stopped (SIGSTOP to their process group: their rescans use no CPU meanwhile), so each round
has the machine to itself, and rounds of one number compare engines under the same outside
load (this host is shared); the median of the per-round full / empty ratios is printed too.
`--profile DIR` runs every engine under `py-spy record` (raw collapsed stacks,
`DIR/<engine>.txt`) and prints the share of samples in the tier's scan functions.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
CONNECTOR_EXTRA = {"cpu_bytes_to_use": "512MiB"}
DISK_BYTES = "16GiB"
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
    out_dir = Path(spec["result_path"]).parent
    (out_dir / "ready").write_text(json.dumps({"engine_start_s": time.perf_counter() - started}))
    rounds = []
    for r in range(1, spec["rounds"] + 1):
        sys.stdin.readline()  # the parent's turn signal (it stops this process in between)
        prompts = batch(r)
        t0, cpu0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rounds.append({"round": r, "wall_s": wall_s, "tokens": tokens,
                       "tokens_per_s": tokens / wall_s,
                       "process_cpu_s": time.process_time() - cpu0})
        (out_dir / f"round-{r}.json").write_text(json.dumps(rounds[-1]))
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
            "kv_connector_extra_config": {**CONNECTOR_EXTRA, "storage_tier": "filesystem",
                                          "storage_options": {"root_dir": str(root),
                                                              "bytes_to_use": DISK_BYTES}}}


class Engine:
    """One engine child process, started and then run round by round; between its turns
    it is stopped (SIGSTOP on its process group: its threads, the disk tier's rescans
    included, use no CPU while another engine is measured)."""

    def __init__(self, name: str, tree: Path, root: Path, spec: dict[str, Any], work: Path,
                 profile: Path | None, omp_cpus: str | None) -> None:
        self.name = name
        self.dir = work / name
        self.dir.mkdir(parents=True)
        spec_path, self.log_path = self.dir / "spec.json", self.dir / "engine.log"
        spec_path.write_text(json.dumps({**spec, "result_path": str(self.dir / "result.json"),
                                         "kv_transfer_config": _transfer_config(root)}))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(tree)}
        if omp_cpus:  # (vLLM's CPU worker pins its OpenMP threads to these CPUs)
            env["VLLM_CPU_OMP_THREADS_BIND"] = omp_cpus
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)]
        if profile is not None:
            cmd = ["py-spy", "record", "-r", "50", "-f", "raw", "--threads", "-o",
                   str(profile / f"{name}.txt"), "--", *cmd]
        print(f"  engine '{name}' ({tree}) over {root} (log {self.log_path}) ...", flush=True)
        self._log = self.log_path.open("w")
        # cwd: the engine's own folder (the checkout's folders must not shadow PYTHONPATH)
        self._proc = subprocess.Popen(cmd, cwd=self.dir, env=env, stdin=subprocess.PIPE,
                                      stdout=self._log, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True)
        self.ready = self._wait_for(self.dir / "ready")
        self._signal(signal.SIGSTOP)

    def run_round(self, r: int) -> dict[str, Any]:
        self._signal(signal.SIGCONT)
        self._proc.stdin.write("go\n")
        self._proc.stdin.flush()
        result = self._wait_for(self.dir / f"round-{r}.json")
        self._signal(signal.SIGSTOP)
        return result

    def finish(self) -> None:
        self._signal(signal.SIGCONT)
        self._proc.stdin.close()
        self._proc.wait(timeout=300)
        self._log.close()

    def _signal(self, sig: int) -> None:
        os.killpg(self._proc.pid, sig)

    def _wait_for(self, path: Path) -> dict[str, Any]:
        while not path.exists():
            if self._proc.poll() is not None:
                raise RuntimeError(f"engine '{self.name}' exited ({self._proc.returncode}):\n"
                                   f"{self.log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        time.sleep(0.05)  # (written whole: small JSON, one write)
        return json.loads(path.read_text())


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
    parser.add_argument("--omp-cpus", help="VLLM_CPU_OMP_THREADS_BIND of the engines (e.g. "
                        "'0': one OpenMP thread on CPU 0, steadier on a host shared with "
                        "other work; default: vLLM's choice)")
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
    full_root = work / "root-full"
    engines: dict[str, Engine] = {}
    fill: dict[str, Any] = {}
    for i, (tree_name, kind) in enumerate(
            [(t, k) for k in ("empty", "full") for t, _ in trees]):
        root = work / (f"root-empty-{tree_name}" if kind == "empty" else "root-full")
        if kind == "full" and not fill:
            layout = _layout_name(work / "root-empty-now")  # (same model: same layout)
            t0 = time.perf_counter()
            print(f"  filling {full_root} with {args.files} files ...", flush=True)
            fill = {**_fill(full_root, layout, args.files),
                    "seconds": time.perf_counter() - t0}
        name = f"{kind}-{tree_name}"
        engines[name] = Engine(name, dict(trees)[tree_name], root,
                               {**spec, "prompt_offset": 100_000 * (i + 1)}, work, args.profile,
                               args.omp_cpus)
    results: dict[str, dict[str, Any]] = {
        name: {"engine_start_s": e.ready["engine_start_s"], "rounds": []}
        for name, e in engines.items()}
    names = list(engines)
    for r in range(1, args.rounds + 1):
        # Every engine once per round, in a rotating order, each alone on the machine.
        for name in names[r % len(names):] + names[:r % len(names)]:
            load = os.getloadavg()[0]
            results[name]["rounds"].append({**engines[name].run_round(r), "load": load})
        print(f"  round {r}: " + ", ".join(
            f"{n} {results[n]['rounds'][-1]['tokens_per_s']:.0f} tok/s" for n in names),
            flush=True)
    for e in engines.values():
        e.finish()
    for name, result in results.items():
        rates = [x["tokens_per_s"] for x in result["rounds"]]
        result["median_tokens_per_s"] = statistics.median(rates)
        result["best_tokens_per_s"] = max(rates)
        if args.profile:
            result["profile"] = _profile_shares(args.profile / f"{name}.txt")

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
    for tree_name, _ in trees:  # (rounds r of both engines ran back to back)
        pairs = [f["tokens_per_s"] / e["tokens_per_s"] for e, f in zip(
            results[f"empty-{tree_name}"]["rounds"], results[f"full-{tree_name}"]["rounds"])]
        summary[tree_name]["median_round_ratio"] = statistics.median(pairs)
        table.notes.append(f"{tree_name}: median of the per-round full / empty ratios "
                           f"{statistics.median(pairs):.2f} (" +
                           ", ".join(f"{x:.2f}" for x in pairs) + ")")
    table.notes.append("1-min load average at each round: " + ", ".join(
        f"{k} " + "/".join(f"{x['load']:.1f}" for x in v["rounds"]) for k, v in results.items()))
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
