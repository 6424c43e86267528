"""Run the real vLLM CPU engine in its own process and print the results as JSON.

Usage: python vllm_runner.py SPEC.json
The spec names a model directory, prompts, engine settings and a list of passes; every pass
sends all prompts, or its own `prompts` (greedy; `one_at_a_time`: batches of one), and may
first reset vLLM's own prefix cache. The last stdout line starting with RESULT_MARKER carries
the results, so vLLM's logging cannot corrupt them. `linger_s`: seconds to wait before
returning (event publishers drain).
Kept separate from pytest so engine processes, threads and env settings never leak into it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

RESULT_MARKER = "E2E_RESULT "

DEFAULT_ENGINE_ARGS: dict[str, Any] = {
    "block_size": 32,  # the CPU attention backend needs a multiple of 32
    "max_model_len": 1024,
    "kv_cache_memory_bytes": 64 * 1024 * 1024,
    "enable_prefix_caching": True,
    "enforce_eager": True,
    "dtype": "bfloat16",
    "seed": 0,
    "max_num_seqs": 8,
}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Start one engine, run every pass of `spec`, return outputs and timings."""
    from vllm import LLM, SamplingParams

    engine_args = {**DEFAULT_ENGINE_ARGS, **spec.get("engine_args", {})}
    if isinstance(engine_args.get("kv_events_config"), dict):  # (LLM takes only the object)
        from vllm.config import KVEventsConfig

        engine_args["kv_events_config"] = KVEventsConfig(**engine_args["kv_events_config"])
    started = time.perf_counter()
    llm = LLM(model=spec["model"], **engine_args)
    engine_start_s = time.perf_counter() - started

    params = SamplingParams(
        temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True,
        logprobs=spec.get("logprobs"),
    )
    passes = []
    for pass_spec in spec.get("passes", [{}]):
        if pass_spec.get("reset_prefix_cache") and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")
        t0 = time.perf_counter()
        prompts = pass_spec.get("prompts", spec["prompts"])  # a pass may send its own
        if pass_spec.get("one_at_a_time"):  # batches of one: numerics independent of timing
            outputs = [out for prompt in prompts
                       for out in llm.generate([prompt], params, use_tqdm=False)]
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        if pass_spec.get("settle_s"):  # background writes end, then a step reports them
            time.sleep(pass_spec["settle_s"])
            llm.generate([pass_spec["settle_prompt"]], params, use_tqdm=False)
        passes.append(
            {
                "seconds": seconds,
                "requests": [
                    {
                        "prompt_len": len(out.prompt_token_ids),
                        "prompt_token_ids": list(out.prompt_token_ids),
                        "num_cached_tokens": out.num_cached_tokens,
                        "token_ids": list(out.outputs[0].token_ids),
                        "text": out.outputs[0].text,
                        # per generated token: {token id: logprob} of the top candidates
                        "logprobs": [
                            {str(t): lp.logprob for t, lp in step.items()}
                            for step in (out.outputs[0].logprobs or [])
                        ],
                    }
                    for out in outputs
                ],
            }
        )
    time.sleep(spec.get("linger_s", 0))  # (lets vLLM's event publisher thread send its queue)
    result = {"engine_start_s": engine_start_s, "passes": passes}
    if spec.get("metrics_prefix"):  # needs engine_args {"disable_log_stats": False}
        result["metrics"] = [
            {"name": m.name, "labels": dict(m.labels), "value": m.value}
            for m in llm.get_metrics()
            if m.name.startswith(spec["metrics_prefix"]) and hasattr(m, "value")
        ]
    return result


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        spec = json.load(f)
    result = run(spec)
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
