"""The vLLM-on-a-GPU check (issue 49): what runs on the lent H200, each step time-bound.

    python3 benchmarks/gpu/run_on_gpu.py --site /tmp/kvo-site --out /tmp/kvo-results
    python benchmarks/gpu/run_on_gpu.py --device cpu --tiny --out /tmp/kvo-dry   # dry run

Why this shape: the GPU machine is lent for 15 minutes with no network, so every bug a CPU
can show must be found before it starts. `--device cpu --tiny` runs the same steps, the same
engine children and the same checks on vLLM's CPU build (only the attention backend, the
device checks and the sizes differ); CI runs it (tests/e2e/test_gpu_kit_dry_run.py).

How: every step is a child process in its own process group with its own time bound (a hung
engine is killed, the next step still runs), and every vLLM engine a step needs is a further
child (a new engine process is what proves the disk tier). A step runs with what is left of
`--budget-s` up to its bound, or is skipped when that is under half its bound. Each step
writes its JSON (and what it measured before a failure); the parent gathers them in
OUT/results.json with a status per step (passed, failed, skipped, timed_out) and appends
every child's output to OUT/run.log.

Steps:
  preflight     the device, torch, vLLM's version, its compiled ops loaded (the kernel module
                of the platform vLLM chose, and how many `_C` ops it registered), the
                platform is the one asked for (CUDA with --device cuda).
  correctness   `kv-offload demo` itself (the README's first command for a GPU user): a
                tiny random-weight model (built here with transformers), greedy tokens
                cold, then after `reset_prefix_cache()` from our host tier, then in a new
                engine process from our disk tier; same tokens, full hits (every whole block
                but the last prompt token's).
  side_by_side  one bigger model (~1B parameters; --tiny: the tiny one), prompts of 8192
                tokens (--tiny: 1024): time to first token recomputed, from vLLM's own
                prefix cache, from our host tier, from our disk tier (new process), and
                from vLLM's native OffloadingConnector's CPU tier (after a reset). Where
                vLLM's build cannot run the native connector (its CPU build refuses it), that
                source is recorded as skipped with vLLM's own words.
  extras        our host hit with `layer_wise: true`, and recompute and host hit with CUDA
                graphs (enforce_eager off); only run when asked for or on CUDA.

Nothing here is a GPU result until OUT/results.json from a GPU run says so: its "device"
and the preflight's "platform" name the machine the figures came from.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

KIT_VERSION = 1
STEPS = ("preflight", "correctness", "side_by_side", "extras")
# Time bound per step, seconds (GPU sizes; --tiny uses the CPU bounds).
BOUNDS_S = {"cuda": {"preflight": 90, "correctness": 150, "side_by_side": 330, "extras": 200},
            "cpu": {"preflight": 120, "correctness": 240, "side_by_side": 300, "extras": 300}}
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32; the GPU run uses the same
HIT_SOURCE_METRIC = "vllm:prompt_tokens_cached_by_source"
# The models: (builder keywords). ~1B: 16 layers x (attention 10.5M + MLP 50.3M) parameters.
TINY_MODEL = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2}
BIG_MODEL = {"layers": 16, "hidden": 2048, "heads": 16, "kv_heads": 4, "intermediate": 8192}
# (the side-by-side step in --tiny mode: a model big enough that a hit is visibly cheaper)
TINY_BIG_MODEL = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2}


class KitError(RuntimeError):
    """A check of the kit failed; the message says what was expected and what to do.
    `result`: what the step measured before it failed (kept in its JSON)."""

    def __init__(self, message: str, result: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.result = result


# ------------------------------------------------------------------------- engine child

def engine_main(spec_path: Path) -> int:
    """One vLLM engine: start it with the spec's settings, run its requests, write JSON."""
    from vllm import LLM, SamplingParams

    spec = json.loads(spec_path.read_text())
    started = time.perf_counter()
    llm = LLM(model=spec["model"], **spec["engine_args"])
    result: dict[str, Any] = {"engine_start_s": time.perf_counter() - started, "requests": []}
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    # A long unrelated prompt first: the engine's first-call costs leave the measured
    # requests, and a first forward of a few tokens can die with SIGILL on some AMX CPUs.
    llm.generate([spec["warmup_prompt"]], params, use_tqdm=False)
    for request in spec["requests"]:
        if request["reset"] and not llm.reset_prefix_cache():
            raise KitError("vLLM refused to reset its prefix cache (requests still running?)")
        time.sleep(request.get("settle_s", 0.0))  # background stores end first
        before = _hits_by_source(llm)
        t0 = time.perf_counter()
        (out,) = llm.generate([request["prompt"]], params, use_tqdm=False)
        wall_s = time.perf_counter() - t0
        after = _hits_by_source(llm)
        result["requests"].append({
            "source": request["source"], "prompt_index": request["prompt_index"],
            "ttft_s": wall_s, "prompt_len": len(out.prompt_token_ids),
            "num_cached_tokens": out.num_cached_tokens or 0,
            "token_ids": list(out.outputs[0].token_ids),
            "hits_by_source": {k: v - before.get(k, 0) for k, v in after.items()
                               if v - before.get(k, 0)}})
    Path(spec["result_path"]).write_text(json.dumps(result))
    del llm  # vLLM's finalizers shut the connector down: pending disk writes are flushed
    return 0


def _hits_by_source(llm: Any) -> dict[str, float]:
    return {m.labels.get("source", "?"): m.value for m in llm.get_metrics()
            if m.name == HIT_SOURCE_METRIC and hasattr(m, "value")}


# --------------------------------------------------------------------------- step child

class Step:
    """What one step process needs: the run's settings and a way to start engines."""

    def __init__(self, config: dict[str, Any], name: str) -> None:
        self.config = config
        self.name = name
        self.work = _mkdir(Path(config["work"]) / name)
        self.device = config["device"]
        self.tiny = config["tiny"]

    def model(self, kind: str) -> Path:
        """The random-weight model `kind` ("tiny" or "big"), built once per run."""
        sizes = {"tiny": TINY_MODEL, "big": TINY_BIG_MODEL if self.tiny else BIG_MODEL}[kind]
        path = Path(self.config["work"]) / "models" / kind
        if (path / "config.json").exists():
            return path
        from kv_offload.testing.tiny_models import build_llama

        t0 = time.perf_counter()
        building = path.with_name(f".{kind}-building")
        where = "cpu"
        if self.device == "cuda":
            # Random init of ~1B parameters: seconds on the GPU, far more on the CPU.
            import torch

            try:
                with torch.device("cuda"):
                    shutil.rmtree(building, ignore_errors=True)
                    build_llama(building, max_positions=self.config["max_model_len"],
                                **sizes)
                where = "cuda"
            except Exception as error:  # (the CPU build below is the fallback)
                log(f"building the {kind} model on the GPU failed ({error!r}): on the CPU")
            torch.cuda.empty_cache()  # (the engines need the memory, not this process)
        if where == "cpu":
            shutil.rmtree(building, ignore_errors=True)
            build_llama(building, max_positions=self.config["max_model_len"], **sizes)
        building.rename(path)  # whole or absent
        log(f"built the {kind} model ({sizes}) on the {where} in "
            f"{time.perf_counter() - t0:.1f} s")
        return path

    def engine_args(self, transfer: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        args: dict[str, Any] = {
            "block_size": BLOCK_SIZE, "max_model_len": self.config["max_model_len"],
            "kv_cache_memory_bytes": self.config["kv_cache_bytes"],
            "enable_prefix_caching": True, "enforce_eager": True, "dtype": "bfloat16",
            "seed": 0, "max_num_seqs": 4, "disable_log_stats": False,
            "kv_transfer_config": transfer}
        if self.device == "cuda" and self.config["attention_backend"]:
            args["attention_config"] = {"backend": self.config["attention_backend"]}
        return {**args, **extra}

    def run_engine(self, label: str, model: Path, engine_args: dict[str, Any],
                   requests: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
        """Start one engine process over `requests`; raise EngineFailed with its log tail."""
        run_dir = _mkdir(self.work / label)
        spec_path, result_path = run_dir / "spec.json", run_dir / "result.json"
        spec_path.write_text(json.dumps({
            "model": str(model), "engine_args": engine_args, "requests": requests,
            "max_tokens": max_tokens, "result_path": str(result_path),
            "warmup_prompt": _prompt(self.config["warmup_tokens"], offset=499)}))
        log(f"[{self.name}] engine '{label}': {len(requests)} requests")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--engine",
                               str(spec_path)], cwd=run_dir, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        (run_dir / "engine.log").write_text(proc.stdout)
        sys.stdout.write(proc.stdout)  # (into run.log, through the step's output)
        if proc.returncode != 0 or not result_path.exists():
            raise EngineFailed(label, proc.returncode, proc.stdout)
        result = json.loads(result_path.read_text())
        result["process_s"] = time.perf_counter() - t0
        return result


class EngineFailed(KitError):
    def __init__(self, label: str, returncode: int, output: str) -> None:
        self.output = output
        lines = [ln for ln in output.splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "Exception" in ln]
        self.reason = (errors or lines or ["(no output)"])[-1].strip()
        super().__init__(f"engine '{label}' exited {returncode}: {self.reason}")


def ours(root_dir: Path, **extra: Any) -> dict[str, Any]:
    """Our connector: host tier in front of a filesystem tier in `root_dir`."""
    return {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kv_offload.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cpu_bytes_to_use": "2GiB",
                                          "storage_tier": "filesystem",
                                          "storage_options": {"root_dir": str(root_dir),
                                                              "bytes_to_use": "8GiB"},
                                          **extra}}


def native(cpu_bytes: int = 2 << 30) -> dict[str, Any]:
    """vLLM's own OffloadingConnector with its CPU tier (what `--kv-offloading-size` sets:
    the connector by name, `cpu_bytes_to_use` a byte count, kv_both)."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}


def _prompt(tokens: int, offset: int = 0) -> str:
    from kv_offload.testing.tiny_vocab import word_prompt

    return word_prompt(tokens, offset=offset)


def full_hit(prompt_len: int) -> int:
    """Tokens a full prefix hit covers: whole blocks, never the last prompt token."""
    return (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE


def step_preflight(step: Step) -> dict[str, Any]:
    import importlib

    import torch

    found: dict[str, Any] = {"python": sys.version.split()[0],
                             "libc": " ".join(platform.libc_ver()), "torch": torch.__version__,
                             "torch_cuda": torch.version.cuda,
                             "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
        found["gpu_memory_gib"] = round(
            torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    import vllm
    from vllm.platforms import current_platform

    found["vllm"] = vllm.__version__
    found["vllm_file"] = vllm.__file__
    found["platform"] = type(current_platform).__name__
    found["platform_device"] = current_platform.device_type
    if step.device == "cuda" and not current_platform.is_cuda():
        raise KitError(f"vLLM chose {found['platform']}, not CUDA: is the CUDA wheel's vllm "
                       f"first on PYTHONPATH (--site) and torch built with CUDA? {found}")
    if step.device == "cpu" and not current_platform.is_cpu():
        raise KitError(f"--device cpu, but vLLM chose {found['platform']}")
    # The platform's compiled ops: vLLM imports this module at start-up and calls its ops.
    kernels = "vllm._C_stable_libtorch" if step.device == "cuda" else "vllm._C"
    t0 = time.perf_counter()
    module = importlib.import_module(kernels)
    found["kernels"] = {"module": kernels, "file": getattr(module, "__file__", None),
                        "import_s": round(time.perf_counter() - t0, 3)}
    ops = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("_C::")]
    found["kernels"]["registered_C_ops"] = len(ops)
    if not ops:
        raise KitError(f"{kernels} imported but registered no _C:: op: built for another "
                       f"torch than {torch.__version__}?")
    from kv_offload.vllm import KVOffloadConnector  # noqa: F401  (our connector imports)

    return found


def step_correctness(step: Step) -> dict[str, Any]:
    """`kv-offload demo` itself, the command the README gives a GPU user: a tiny random-weight
    model, greedy tokens cold, then from our host tier after vLLM's own cache is dropped, then
    from our disk tier in a new engine process; same tokens, full hits."""
    out = step.work / "demo.json"
    cmd = [sys.executable, "-m", "kv_offload.tools.demo", "--model-size", "tiny",
           "--prompts", "2", "--prompt-tokens", "300", "--max-tokens", "8", "--repeats", "1",
           "--cache-dir", str(_mkdir(step.work / "models")),
           "--work-dir", str(_mkdir(step.work / "demo")), "--json", str(out)]
    if step.device == "cuda" and step.config["attention_backend"]:
        cmd += ["--attention-backend", step.config["attention_backend"]]
    log(f"[{step.name}] {' '.join(cmd[1:])}")
    proc = subprocess.run(cmd, cwd=step.work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    sys.stdout.write(proc.stdout)  # (into run.log, through the step's output)
    if not out.exists():
        raise EngineFailed("demo", proc.returncode, proc.stdout)
    demo = json.loads(out.read_text())["results"]
    passes = {p["name"]: p for p in demo["passes"]}
    checks: dict[str, Any] = {"engine": demo["engine"], "demo_exit": proc.returncode}
    for source in ("host", "disk"):
        requests = passes[source]["requests"]
        checks[source] = {
            "same_tokens": passes[source]["identical"],
            "full_hits": all(r["num_cached_tokens"] >= full_hit(r["prompt_len"])
                             for r in requests),
            "cached_tokens": [r["num_cached_tokens"] for r in requests],
            "full_hit_tokens": [full_hit(r["prompt_len"]) for r in requests],
            "seconds": passes[source]["seconds"]}
    checks["cold_cached_tokens"] = [r["num_cached_tokens"]
                                    for r in passes["cold"]["requests"]]
    checks["cold_seconds"] = passes["cold"]["seconds"]
    checks["token_ids"] = [r["token_ids"] for r in passes["cold"]["requests"]]
    bad = [s for s in ("host", "disk")
           if not (checks[s]["same_tokens"] and checks[s]["full_hits"])]
    if bad or proc.returncode != 0:
        raise KitError(f"correctness (kv-offload demo) failed for {bad or 'its exit code'}: "
                       f"{json.dumps(checks)}", checks)
    return checks


def step_side_by_side(step: Step) -> dict[str, Any]:
    cfg = step.config
    model = step.model("big")
    n, tokens = cfg["prompts"], cfg["prompt_tokens"]
    prompts = [_prompt(tokens, offset=17 * (i + 1)) for i in range(n)]

    def reqs(*pattern: tuple[str, bool]) -> list[dict[str, Any]]:
        return [{"source": src, "prompt": p, "prompt_index": i, "reset": reset,
                 "settle_s": cfg["settle_s"]}
                for i, p in enumerate(prompts) for src, reset in pattern]

    engines = [
        ("no-connector", None, reqs(("recompute", False), ("vllm_hit", False),
                                    ("recompute", True))),
        ("ours", ours(_mkdir(step.work / "disk")),
         reqs(("ours_cold", False), ("ours_host", True))),
        ("ours-new-process", ours(step.work / "disk"), reqs(("ours_disk", False))),
        ("native", native(), reqs(("native_cold", False), ("native_cpu", True))),
    ]
    rows: list[dict[str, Any]] = []
    engine_notes: dict[str, Any] = {}
    for label, transfer, requests in engines:
        # (an engine that fails is recorded and the others still run: one GPU attempt
        # should bring back every figure it can)
        try:
            result = step.run_engine(label, model, step.engine_args(transfer), requests,
                                     max_tokens=1)
        except EngineFailed as failed:
            # vLLM's CPU build refuses its own CPU offloading ("only supported on
            # CUDA-alike and XPU GPUs"): a reason to record, not a kit failure there.
            refused = label == "native" and step.device == "cpu"
            status = "skipped" if refused else "failed"
            engine_notes[label] = {"status": status, "reason": failed.reason}
            log(f"[side_by_side] engine '{label}' {status}: {failed.reason}")
            continue
        engine_notes[label] = {"status": "ran", "engine_start_s": result["engine_start_s"],
                               "process_s": result["process_s"]}
        rows += result["requests"]
    summary = summarise(rows, tokens)
    summary["engines"] = engine_notes
    summary["model"] = {"sizes": TINY_BIG_MODEL if step.tiny else BIG_MODEL,
                        "parameters": _parameters(model)}
    summary["prompts"], summary["prompt_tokens"] = n, tokens
    summary["problems"] += [f"engine '{k}' failed: {v['reason']}"
                            for k, v in engine_notes.items() if v["status"] == "failed"]
    if summary["problems"]:
        raise KitError(f"side by side: {summary['problems']}", summary)
    return summary


SOURCES = ("recompute", "vllm_hit", "ours_cold", "ours_host", "ours_disk", "native_cold",
           "native_cpu")
MUST_HIT = ("vllm_hit", "ours_host", "ours_disk", "native_cpu")


def summarise(rows: list[dict[str, Any]], prompt_tokens: int) -> dict[str, Any]:
    """Median TTFT per source, its ratio to recompute and to vLLM's own hit, and problems:
    a hit that was not full, a token that differs from the recomputed one."""
    reference = {r["prompt_index"]: r["token_ids"] for r in rows if r["source"] == "recompute"}
    ttft: dict[str, Any] = {}
    problems: list[str] = []
    for source in SOURCES:
        mine = [r for r in rows if r["source"] == source]
        if not mine:
            continue
        median = statistics.median(r["ttft_s"] for r in mine)
        ttft[source] = {"median_s": median, "samples_s": [r["ttft_s"] for r in mine],
                        "cached_tokens": [r["num_cached_tokens"] for r in mine],
                        "hits_by_source": [r["hits_by_source"] for r in mine]}
        if any(r["token_ids"] != reference.get(r["prompt_index"]) for r in mine):
            problems.append(f"{source}: a token differs from the recomputed one")
        if source in MUST_HIT and any(r["num_cached_tokens"] < full_hit(r["prompt_len"])
                                      for r in mine):
            problems.append(f"{source}: not a full hit ({ttft[source]['cached_tokens']}, "
                            f"full: {full_hit(prompt_tokens)})")
    base = ttft.get("recompute", {}).get("median_s")
    own = ttft.get("vllm_hit", {}).get("median_s")
    for entry in ttft.values():
        entry["x_recompute"] = entry["median_s"] / base if base else None
        entry["x_vllm_hit"] = entry["median_s"] / own if own else None
    return {"ttft": ttft, "problems": problems}


def step_extras(step: Step) -> dict[str, Any]:
    """Layer-wise loads, and CUDA graphs (enforce_eager off), each against its own cold."""
    cfg = step.config
    model = step.model("big")
    prompts = [_prompt(cfg["prompt_tokens"], offset=301 + 13 * i) for i in range(cfg["prompts"])]

    def reqs(cold: str, hit: str) -> list[dict[str, Any]]:
        return [{"source": src, "prompt": p, "prompt_index": i, "reset": reset,
                 "settle_s": cfg["settle_s"]}
                for i, p in enumerate(prompts) for src, reset in ((cold, False), (hit, True))]

    found: dict[str, Any] = {}
    # cuda_graphs: full CUDA graphs for decode without torch.compile (inductor is where
    # torch 2.11 under vLLM 0.32 is least likely to hold), 8 tokens so graphs replay;
    # its "TTFT" is then the time of 8 tokens, compared with its own cold pass.
    variants = [("layer_wise", ours(_mkdir(step.work / "disk-lw"), layer_wise=True), {}, 1)]
    if step.device == "cuda":
        variants.append(("cuda_graphs", ours(_mkdir(step.work / "disk-graphs")),
                         {"enforce_eager": False, "compilation_config": {
                             "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}, 8))
    else:
        found["cuda_graphs"] = {"status": "skipped", "reason": "no CUDA graphs on the CPU"}
    for label, transfer, extra, max_tokens in variants:
        try:
            result = step.run_engine(label, model, step.engine_args(transfer, **extra),
                                     reqs("cold", "host"), max_tokens=max_tokens)
        except EngineFailed as failed:
            found[label] = {"status": "failed", "reason": failed.reason}
            continue
        rows = [{**r, "source": "recompute" if r["source"] == "cold" else "ours_host"}
                for r in result["requests"]]
        found[label] = {"status": "ran", "max_tokens": max_tokens,
                        **summarise(rows, cfg["prompt_tokens"])}
    failed = {k: v for k, v in found.items() if v["status"] == "failed" or v.get("problems")}
    if failed:
        raise KitError(f"extras: {json.dumps(failed)}"[:2000], found)
    return found


def _parameters(model: Path) -> int:
    """The model's parameter count, read from its safetensors headers."""
    from safetensors import safe_open

    total = 0
    for path in model.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open is not iterable)
                total += math.prod(f.get_slice(key).get_shape())
    return total


STEP_FUNCTIONS = {"preflight": step_preflight, "correctness": step_correctness,
                  "side_by_side": step_side_by_side, "extras": step_extras}


def step_main(name: str, config_path: Path) -> int:
    config = json.loads(config_path.read_text())
    out = Path(config["out"]) / "steps" / f"{name}.json"
    t0 = time.perf_counter()
    try:
        result = STEP_FUNCTIONS[name](Step(config, name))
        document = {"status": "passed", "result": result}
        code = 0
    except Exception as error:  # (recorded for the parent, which goes on to the next step)
        import traceback

        traceback.print_exc()
        document = {"status": "failed", "error": f"{type(error).__name__}: {error}"[:4000]}
        if getattr(error, "result", None) is not None:
            document["result"] = error.result
        code = 1
    document["seconds"] = round(time.perf_counter() - t0, 2)
    out.write_text(json.dumps(document, indent=1))
    return code


# ------------------------------------------------------------------------------ parent

def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_step(name: str, config_path: Path, bound_s: float, log_file: Any,
             env: dict[str, str]) -> dict[str, Any]:
    """One step in its own process group, killed with all its engines past `bound_s`."""
    out = Path(json.loads(config_path.read_text())["out"]) / "steps" / f"{name}.json"
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--step", name,
                             "--config", str(config_path)], stdout=log_file,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        proc.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {"status": "timed_out", "seconds": round(time.perf_counter() - t0, 2),
                "bound_s": bound_s,
                "error": f"past its bound of {bound_s:.0f} s: killed with its engines "
                         "(see run.log; raise --bound NAME=SECONDS if it was only slow)"}
    if out.exists():
        document = json.loads(out.read_text())
    else:
        document = {"status": "failed", "error": f"the step process exited {proc.returncode} "
                    "without its JSON (killed? see run.log)"}
    document["bound_s"] = bound_s
    document["wall_s"] = round(time.perf_counter() - t0, 2)
    return document


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="results folder (results.json, run.log, steps/)")
    p.add_argument("--work", type=Path, help="models, disk tiers, engine logs "
                   "(default OUT/work; deleted at the end unless --keep-work)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true",
                   help="small models and prompts (the CPU dry run)")
    p.add_argument("--site", type=Path, action="append", default=[],
                   help="a folder to put first on PYTHONPATH (the unpacked vLLM and wheels)")
    p.add_argument("--steps", default=None,
                   help=f"comma-separated, of {','.join(STEPS)} (default: all on cuda, "
                        "all but extras on cpu)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="the whole run's time: a step gets what is left, up to its bound, "
                        "and is skipped when that is under half its bound")
    p.add_argument("--bound", action="append", default=[], metavar="STEP=SECONDS",
                   help="override one step's time bound")
    p.add_argument("--prompt-tokens", type=int)
    p.add_argument("--prompts", type=int)
    p.add_argument("--attention-backend", default="TRITON_ATTN",
                   help="vLLM attention backend on CUDA (FLEX_ATTENTION as a fallback; "
                        "'' for vLLM's choice)")
    p.add_argument("--keep-work", action="store_true")
    p.add_argument("--engine", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not (args.engine or args.step) and args.out is None:
        p.error("--out is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine:
        return engine_main(args.engine)
    if args.step:
        return step_main(args.step, args.config)
    out = _mkdir(args.out.resolve())
    work = _mkdir((args.work or out / "work").resolve())
    _mkdir(out / "steps")
    steps = args.steps.split(",") if args.steps else \
        [s for s in STEPS if args.device == "cuda" or s != "extras"]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise SystemExit(f"unknown steps {unknown}: choose from {', '.join(STEPS)}")
    bounds = dict(BOUNDS_S["cpu" if args.tiny or args.device == "cpu" else "cuda"])
    for item in args.bound:
        key, _, value = item.partition("=")
        if key not in STEPS or not value:
            raise SystemExit(f"--bound {item!r}: write STEP=SECONDS, STEP one of {STEPS}")
        bounds[key] = float(value)
    prompt_tokens = args.prompt_tokens or (1024 if args.tiny else 8192)
    config = {
        "kit_version": KIT_VERSION, "out": str(out), "work": str(work), "device": args.device,
        "tiny": args.tiny, "prompt_tokens": prompt_tokens,
        "prompts": args.prompts or (1 if args.tiny else 3),
        "max_model_len": -(-(prompt_tokens + 64) // BLOCK_SIZE) * BLOCK_SIZE,
        "kv_cache_bytes": (256 << 20) if args.tiny else (8 << 30),
        "warmup_tokens": 256 if args.tiny else 2048,
        "settle_s": 0.5 if args.tiny else 1.0,
        "attention_backend": args.attention_backend}
    config_path = out / "config.json"
    config_path.write_text(json.dumps(config, indent=1))
    env = dict(os.environ)
    here = Path(__file__).resolve().parents[2]  # the checkout: kv_offload importable
    paths = [str(p.resolve()) for p in args.site] + [str(here)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    if args.device == "cpu":
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    started, t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.perf_counter()
    document: dict[str, Any] = {"kit_version": KIT_VERSION, "device": args.device,
                                "tiny": args.tiny, "started": started, "config": config,
                                "steps": {}}
    results = out / "results.json"
    with (out / "run.log").open("a") as log_file:
        for name in steps:
            left = args.budget_s - (time.perf_counter() - t0)
            bound = min(bounds[name], left)  # (what is left, up to the step's own bound)
            if bound < bounds[name] / 2:
                document["steps"][name] = {"status": "skipped", "reason": (
                    f"{left:.0f} s left of --budget-s, under half its bound "
                    f"({bounds[name]:.0f} s)")}
            elif name != "preflight" and document["steps"].get("preflight", {}).get(
                    "status") not in (None, "passed"):
                document["steps"][name] = {"status": "skipped",
                                           "reason": "the preflight did not pass"}
            else:
                log_file.write(f"\n===== step {name} (bound {bound:.0f} s)\n")
                log_file.flush()
                document["steps"][name] = run_step(name, config_path, bound, log_file, env)
            entry = document["steps"][name]
            why = "" if entry["status"] == "passed" else \
                f" - {entry.get('error', entry.get('reason', ''))}"
            log(f"{name}: {entry['status']} {entry.get('wall_s', '')}{why}"[:600])
            document["wall_s"] = round(time.perf_counter() - t0, 1)
            results.write_text(json.dumps(document, indent=1))  # (after every step)
    document["summary"] = summary(document)
    results.write_text(json.dumps(document, indent=1))
    print(json.dumps(document["summary"], indent=1))
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(s["status"] in ("passed", "skipped") for s in document["steps"].values()) \
        else 1


def summary(document: dict[str, Any]) -> dict[str, Any]:
    """The few lines a reader wants: each step's status and the side-by-side medians."""
    steps = document["steps"]
    found: dict[str, Any] = {"device": document["device"], "tiny": document["tiny"],
                             "status": {k: v["status"] for k, v in steps.items()}}
    pre = steps.get("preflight", {}).get("result")
    if pre:
        found["platform"] = f"{pre['platform']} vllm {pre['vllm']} torch {pre['torch']}"
    corr = steps.get("correctness", {}).get("result")
    if corr:
        found["correctness"] = {s: {"same_tokens": corr[s]["same_tokens"],
                                    "full_hits": corr[s]["full_hits"]} for s in ("host", "disk")}
    side = steps.get("side_by_side", {}).get("result")
    if side:
        found["ttft_median_s"] = {k: round(v["median_s"], 4) for k, v in side["ttft"].items()}
        found["ttft_x_recompute"] = {k: round(v["x_recompute"], 3)
                                     for k, v in side["ttft"].items() if v["x_recompute"]}
        found["native"] = side["engines"].get("native")
    return found


if __name__ == "__main__":
    sys.exit(main())
