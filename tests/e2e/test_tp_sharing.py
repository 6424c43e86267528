"""One cache for TP=1 and TP=2 on the real vLLM CPU engine: a prefix stored by a TP=2 engine
is served to a TP=1 engine through the disk tier, and one stored by a TP=1 engine is served
to a TP=2 engine through a shared Valkey server.

Four engine processes (the tiny Llama-like model, 2 KV heads: a TP=2 rank holds one):
- the TP=2 writer computes the prompts (disk tier), then is served them by vLLM's own cache:
  the TP=2 references;
- the TP=1 writer does the same with the Valkey tier: the TP=1 references;
- a fresh TP=1 engine over the TP=2 writer's directory (its host tier empty, so every
  token it reports cached came from records that two TP=2 ranks wrote, one head each), and
- a fresh TP=2 engine over the TP=1 writer's Valkey prefix (each rank takes its head out of
  the one record the TP=1 rank wrote)
must report the whole prefix cached and generate the tokens of recompute at their own TP
size, or those of the TP size that computed the prefix: the prefix KV itself was computed at
the other TP size (its all-reduces round differently in bf16: the two TP sizes' own outputs
differ by up to ~0.13 in a top-5 logprob here, and their top-5 sets differ), so where the two
TP sizes' own generations part at a near-tie, the reader may follow either (on an AVX2-only
machine one request's fourth token does: the TP=2 reader follows the TP=1 writer).
The logprobs cannot be bit-identical to vLLM's own cache at the reader's TP size either:
at every generated position that both saw the same tokens before, the reader's top-5
logprobs must be within `LOGPROB_TOLERANCE` of vLLM's own cache at the reader's TP size
(measured: 0.004), which on an AVX2-only machine is an order of magnitude inside the gap
between the TP sizes themselves (with AVX-512 BF16 and AMX the TP sizes differ by only
0.004: the test prints the gap and does not require it); wrong heads or misplaced bytes
change tokens and logprobs far more (the byte-exact proof is the unit tests').
Runs in 3 minutes here on a quiet machine (two TP=2 engines, multiprocess), 6 to 10 under
the load of other developers' jobs.
"""

from __future__ import annotations

import os

import pytest
from engine_harness import run_engine, token_ids
from test_connector import PROMPTS, cached, connector_config, full_prefixes, outputs, spec
from test_shared_stores import shared_config, shared_secret, valkey_url  # noqa: F401 (fixtures)

pytestmark = pytest.mark.e2e

LOGPROB_TOLERANCE = 0.02
TP2 = {"engine_args": {"tensor_parallel_size": 2}, "multiprocess": True,
       "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, "timeout_s": 600}


def engine(model, tmp_path, name: str, passes, config, tp: int):
    extra = TP2 if tp == 2 else {"engine_args": {}}
    run_spec = spec(model, passes, config, engine_args=extra["engine_args"])
    kwargs = {k: v for k, v in extra.items() if k != "engine_args"}
    return run_engine(run_spec, tmp_path / name, **kwargs)


def test_a_prefix_crosses_tp_sizes_through_disk_and_valkey(
        tiny_models, tmp_path, valkey_url, shared_secret):  # noqa: F811
    model, disk = tiny_models["llama"], connector_config(tmp_path / "kv")
    valkey = shared_config("valkey", {"url": valkey_url, "key_prefix": f"e2e-tp-{os.getpid()}:"},
                           "64MiB", shared_secret)
    w2 = engine(model, tmp_path, "w2", [{}, {}], disk, tp=2)
    w1 = engine(model, tmp_path, "w1", [{}, {}], valkey, tp=1)
    r1 = engine(model, tmp_path, "r1", [{}], disk, tp=1)  # TP=2 -> TP=1 through disk
    r2 = engine(model, tmp_path, "r2", [{}], valkey, tp=2)  # TP=1 -> TP=2 through Valkey

    # How far the two TP sizes' own outputs are apart depends on the CPU's kernels: ~0.13 on
    # an AVX2-only machine, 0.004 with AVX-512 BF16 and AMX (fp32 accumulation). Either way a
    # reader that took the wrong head or misplaced bytes is far outside the tolerance below.
    print(f"TP=1 vs TP=2 own outputs: largest top-5 logprob difference "
          f"{deviation(w1['passes'][0], w2['passes'][0]):.3g}")
    # (the reader, the writer at its own TP size, the writer that computed its prefix)
    for writer, source, (reader,) in ((w1, w2, r1["passes"]), (w2, w1, r2["passes"])):
        computed, engine_cached = writer["passes"]
        assert cached(computed) == [0] * len(PROMPTS)
        assert cached(reader) == full_prefixes(reader) == cached(engine_cached)  # all hit
        assert token_ids(computed) == token_ids(engine_cached)
        for got, own, other in zip(token_ids(reader), token_ids(computed),
                                   token_ids(source["passes"][0]), strict=True):
            assert got in (own, other)
        assert deviation(reader, engine_cached, same_tokens_before=True) <= LOGPROB_TOLERANCE
    for name in ("r1", "r2"):
        assert "will be recomputed" not in (tmp_path / name / "engine.log").read_text()


def deviation(a: dict, b: dict, same_tokens_before: bool = False) -> float:
    """The largest difference of a top-5 logprob of a token both passes list, over every
    generated position of every request (`same_tokens_before`: only positions both passes
    reached with the same tokens)."""
    worst = 0.0
    for (tokens_a, steps_a), (tokens_b, steps_b) in zip(outputs(a), outputs(b), strict=True):
        for k, (top_a, top_b) in enumerate(zip(steps_a, steps_b, strict=True)):
            if same_tokens_before and tokens_a[:k] != tokens_b[:k]:
                break
            for token in top_a.keys() & top_b.keys():
                worst = max(worst, abs(top_a[token] - top_b[token]))
    return worst
