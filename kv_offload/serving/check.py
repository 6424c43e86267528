"""The client-side check behind `kv-offload serve-check URL`: is this server's KV served by
kv-offload, and served right?

What it does against a running vLLM OpenAI-compatible server (best on an idle one: the
metric checks compare counter deltas with what this client alone sent):

  server            `GET /health`, the model, vLLM's block size (from `/metrics`);
  connector         the connector's `vllm:kv_offload_*` metrics are exposed;
  server flags      what the checks need from the server's command line, before any prompt
                    is sent: `usage.prompt_tokens_details` (--enable-prompt-tokens-details,
                    seen on one throwaway completion) and `POST /reset_prefix_cache`
                    (VLLM_SERVER_DEV_MODE=1; not needed to replay); each one missing is named
                    with its fix, and the run stops there;
  prompts           N new prompts of T tokens (random words run through the server's own
                    tokenizer, `POST /tokenize`, then sent as token ids: exactly T tokens);
  cold pass         each prompt once, greedy, with top logprobs: computed by the engine
                    (and stored by the connector);
  vLLM cache pass   the prompts again, served by vLLM's own prefix cache: the reference;
  reset             `POST /reset_prefix_cache` (VLLM_SERVER_DEV_MODE=1): vLLM's own cache
                    is dropped, the connector's is not;
  same outputs      the prompts a third time, the prefix now loaded by kv-offload: the same
                    tokens and logprobs as the reference;
  cached tokens     `usage.prompt_tokens_details.cached_tokens` covers each prompt's
                    cacheable prefix (whole blocks, never the last prompt token);
  metrics agree     the connector's hit counters grew by exactly the cached tokens the
                    client saw (less vLLM's own hits), its lookups by the prompt tokens sent,
                    vLLM's count of connector tokens agrees, and no load failed;
  healthy after     `GET /health` again.

Why vLLM's own cache is the reference and not the cold pass: a prompt whose prefix comes from
a cache is computed as a short prefill over cached KV, the cold pass as one long prefill, and
the two may round differently in the last bits (they do for some prompts on the CPU build,
without any connector). Loading the same KV bytes from kv-offload must give exactly what
vLLM's own cache gives; the cold pass is still compared, and its tokens reported.

`record` writes the prompts and both passes' outputs to a file; `replay` skips the first two
passes and compares against such a file instead — e.g. after restarting the server over the
same disk directory, where every hit must come from disk. Checks that fail stop nothing but
those that need them; the report lists every check with its evidence.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kv_offload.errors import ServeCheckInputError, ServingError
from kv_offload.serving.client import (
    Completion,
    ResetResult,
    ServingClient,
    compare_outputs,
)
from kv_offload.serving.metrics import OffloadCounters, ServerMetrics
from kv_offload.serving.record import load_record, write_record

_RESET_TRIES = 60  # vLLM refuses while blocks are held (a load in flight): 30 s on a busy host
_METRICS_WAIT_S = 10.0  # the front end records a step's stats just after sending its outputs


@dataclass(frozen=True)
class CheckOptions:
    url: str
    model: str | None = None
    prompts: int = 3
    prompt_tokens: int = 512
    max_tokens: int = 8
    logprobs: int = 5
    logprob_tolerance: float = 0.0
    seed: int | None = None
    record: Path | None = None
    replay: Path | None = None
    api_key: str = "EMPTY"
    timeout_s: float = 120.0


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool | None
    """True, False, or None when the check was skipped (with the reason in `detail`)."""
    detail: str


@dataclass
class CheckReport:
    url: str
    model: str | None = None
    block_size: int | None = None
    seed: int | None = None
    checks: list[CheckResult] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    recompute: list[Completion] = field(default_factory=list)
    """The cold pass: every token computed by the engine."""
    reference: list[Completion] = field(default_factory=list)
    """The prompts served by vLLM's own prefix cache: what the served pass must equal."""
    served: list[Completion] = field(default_factory=list)
    """The prompts with their prefix loaded by kv-offload."""
    counters: OffloadCounters | None = None
    """The connector's counter deltas over the served pass."""
    step: str = "server"
    """The step running: a request that fails is reported under its name."""

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed is not False for c in self.checks)

    def add(self, name: str, passed: bool | None, detail: str) -> bool:
        self.checks.append(CheckResult(name, passed, detail))
        return passed is not False

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url, "model": self.model, "block_size": self.block_size,
            "seed": self.seed, "passed": self.passed,
            "checks": [vars(c) for c in self.checks],
            "prompt_tokens": [len(p) for p in self.prompts],
            "recompute": [c.to_json() for c in self.recompute],
            "reference": [c.to_json() for c in self.reference],
            "served": [c.to_json() for c in self.served],
            "counters": None if self.counters is None else vars(self.counters),
        }


def cacheable_tokens(prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens a prefix cache can serve: whole blocks, never the last prompt token."""
    return (prompt_tokens - 1) // block_size * block_size


def run_check(options: CheckOptions) -> CheckReport:
    """Run the checks in order; a failed check skips only what depends on it.

    A request that fails (an HTTP error, a dead server) ends the run as a failed check named
    after the step; bad arguments or a bad record raise ServeCheckInputError.
    """
    import httpx
    import openai

    report = CheckReport(url=options.url)
    with ServingClient(options.url, api_key=options.api_key, timeout_s=options.timeout_s,
                       model=options.model) as client:
        try:
            _run_steps(client, options, report)
        except (ServingError, openai.APIError, httpx.HTTPError) as e:
            report.add(report.step, False, f"request failed: {type(e).__name__}: {e}")
    return report


def _run_steps(client: ServingClient, options: CheckOptions, report: CheckReport) -> None:
    metrics = _check_server(client, report)
    if metrics is None:
        return
    # (both, so that one run names every fix: a server restarted once, not twice)
    connector = _check_connector(metrics, report)
    report.step = "server flags"
    if not _check_flags(client, options, report) or not connector:
        return
    report.step = "prompts"
    if options.replay is not None:
        record = load_record(options.replay, report.model)
        report.add("prompts", True, f"{len(record.prompts)} recorded prompts from "
                   f"{options.replay}")
        report.prompts, report.recompute = record.prompts, record.recompute
        report.reference = record.reference
        options = replace(options, max_tokens=record.max_tokens, logprobs=record.logprobs)
    else:
        prompts = _make_prompts(client, options, report)
        if prompts is None:
            return
        report.prompts = prompts
        report.step = "cold pass"
        report.recompute = _cold_pass(client, prompts, options, report)
        report.step = "vLLM cache pass"
        report.reference = _vllm_cache_pass(client, report, options)
        if options.record is not None:
            write_record(options.record, report, options.max_tokens, options.logprobs)
    report.step = "reset"
    if not _reset(client, report, optional=options.replay is not None):
        return
    report.step = "served pass"
    _served_pass(client, options, report)
    report.step = "healthy after"
    healthy = client.health()
    report.add("healthy after", healthy, "GET /health answers 200" if healthy else
               "GET /health does not answer 200 any more")


def _check_server(client: ServingClient, report: CheckReport) -> ServerMetrics | None:
    if not client.health():
        report.add("server", False, f"GET {client.root}/health does not answer 200")
        return None
    report.model = client.model
    metrics = client.metrics()
    report.block_size = metrics.block_size
    if metrics.block_size is None:
        report.add("server", False, "vllm:cache_config_info (vLLM's block size) is missing "
                   "from /metrics")
        return None
    caching = {True: "on", False: "OFF", None: "unknown"}[metrics.prefix_caching]
    report.add("server", True, f"model {report.model}, block size {metrics.block_size}, "
               f"prefix caching {caching}")
    return metrics


def _check_connector(metrics: ServerMetrics, report: CheckReport) -> bool:
    if metrics.offload is None:
        return report.add("connector", False, "no vllm:kv_offload_faults_total on /metrics: "
                          "the server runs without KVOffloadConnector (--kv-transfer-config; "
                          "vLLM's own offloading connector exposes other vllm:kv_offload_* "
                          "metrics) or with --disable-log-stats")
    return report.add("connector", True, "KVOffloadConnector metrics on /metrics")


def _check_flags(client: ServingClient, options: CheckOptions, report: CheckReport) -> bool:
    """The server's flags the later checks need, found before any prompt of the check is
    sent: one throwaway completion (a new prompt, as long as the check's: a first forward of
    a few tokens kills vLLM's CPU worker on AMX machines) and a prefix cache reset (dropping
    vLLM's own cache before the passes changes nothing they measure)."""
    missing = []
    rng = random.SystemRandom()
    probe = client.tokenize(" ".join(f"w{rng.randrange(500)}"
                                     for _ in range(options.prompt_tokens)))
    length = options.prompt_tokens
    if probe.max_model_len is not None:
        length = min(length, probe.max_model_len - 1)
    done = client.complete(probe.token_ids[:length], max_tokens=1, logprobs=1)
    if done.cached_tokens is None:
        missing.append("the server reports no usage.prompt_tokens_details: start it with "
                       "--enable-prompt-tokens-details")
    reset = client.reset_prefix_cache()
    if reset is ResetResult.UNAVAILABLE and options.replay is None:
        missing.append("no POST /reset_prefix_cache: start the server with "
                       "VLLM_SERVER_DEV_MODE=1 so vLLM's own cache can be dropped and the "
                       "connector's hits seen (or --replay a record: its hits from vLLM's "
                       "own cache are subtracted instead)")
    if missing:
        return report.add("server flags", False, "; ".join(missing))
    found = ("usage.prompt_tokens_details reported; POST /reset_prefix_cache "
             + ("available" if reset is not ResetResult.UNAVAILABLE else
                "absent (not needed to replay)"))
    return report.add("server flags", True, found)


def _make_prompts(client: ServingClient, options: CheckOptions,
                  report: CheckReport) -> list[list[int]] | None:
    if options.prompt_tokens <= report.block_size:
        report.add("prompts", False, f"--prompt-tokens {options.prompt_tokens} must exceed the "
                   f"block size {report.block_size}: shorter prompts have no cacheable block")
        return None
    seed = options.seed if options.seed is not None else random.SystemRandom().randrange(2**31)
    report.seed = seed
    rng = random.Random(seed)
    prompts = []
    for _ in range(options.prompts):
        # Words of the tiny test vocabulary are one token there and one or more elsewhere;
        # the server's tokenizer decides, and the ids are cut to exactly prompt_tokens.
        text = " ".join(f"w{rng.randrange(500)}" for _ in range(options.prompt_tokens))
        tokenized = client.tokenize(text)
        limit = tokenized.max_model_len
        if limit is not None and options.prompt_tokens + options.max_tokens > limit:
            raise ServeCheckInputError(
                f"--prompt-tokens {options.prompt_tokens} + --max-tokens {options.max_tokens} "
                f"exceeds the server's max_model_len {limit}")
        prompts.append(tokenized.token_ids[: options.prompt_tokens])
    report.add("prompts", True, f"{len(prompts)} new prompts x {options.prompt_tokens} tokens "
               f"(seed {seed})")
    return prompts


def _cold_pass(client: ServingClient, prompts: list[list[int]], options: CheckOptions,
               report: CheckReport) -> list[Completion]:
    outputs = _send_all(client, prompts, options)
    cached = sum(c.cached_tokens or 0 for c in outputs)
    report.add("cold pass", True, f"{len(outputs)} completions computed by the engine "
               f"({cached} prompt tokens already cached)")
    return outputs


def _vllm_cache_pass(client: ServingClient, report: CheckReport,
                    options: CheckOptions) -> list[Completion]:
    outputs = _send_all(client, report.prompts, options)
    cached = sum(c.cached_tokens or 0 for c in outputs)
    same = sum(compare_outputs(r, c).same_tokens for r, c in zip(report.recompute, outputs))
    worst = max(compare_outputs(r, c).max_logprob_diff for r, c in zip(report.recompute,
                                                                         outputs))
    report.add("vLLM cache pass", True, f"the reference: {cached} prompt tokens from vLLM's "
               f"own cache; vs the cold pass: same tokens {same}/{len(outputs)}, max |logprob "
               f"diff| {worst:.3g}")
    return outputs


def _send_all(client: ServingClient, prompts: list[list[int]],
              options: CheckOptions) -> list[Completion]:
    # One at a time: batch composition then matches across passes, so logprobs can match
    # bit for bit.
    return [client.complete(p, max_tokens=options.max_tokens, logprobs=options.logprobs)
            for p in prompts]


def _reset(client: ServingClient, report: CheckReport, *, optional: bool) -> bool:
    for _ in range(_RESET_TRIES):
        result = client.reset_prefix_cache()
        if result is not ResetResult.BUSY:
            break
        time.sleep(0.5)
    if result is ResetResult.RESET:
        return report.add("reset", True, "POST /reset_prefix_cache: vLLM's own cache dropped")
    if result is ResetResult.UNAVAILABLE:
        if optional:
            return report.add("reset", None, "no POST /reset_prefix_cache (server without "
                              "VLLM_SERVER_DEV_MODE=1): hits from vLLM's own cache are "
                              "subtracted instead")
        return report.add("reset", False, "no POST /reset_prefix_cache: start the server with "
                          "VLLM_SERVER_DEV_MODE=1 so vLLM's own cache can be dropped and the "
                          "connector's hits seen")
    return report.add("reset", False, f"vLLM refused to reset its prefix cache "
                      f"{_RESET_TRIES} times (requests still running?)")


def _served_pass(client: ServingClient, options: CheckOptions, report: CheckReport) -> None:
    before = client.metrics()
    served = _send_all(client, report.prompts, options)
    report.served = served
    _check_same_outputs(report, options.logprob_tolerance)
    if not _check_cached(served, report):
        return
    after = _settled_metrics(client, before, served)
    _check_metrics(before, after, served, report)


def _check_same_outputs(report: CheckReport, tolerance: float) -> None:
    served = report.served
    problems, worst = [], 0.0
    for i, (ref, got) in enumerate(zip(report.reference, served)):
        diff = compare_outputs(ref, got)
        worst = max(worst, diff.max_logprob_diff)
        if not diff.same_tokens:
            problems.append(f"prompt {i}: generated token {diff.first_difference} differs")
        elif not diff.identical(tolerance):
            problems.append(f"prompt {i}: logprobs differ by up to {diff.max_logprob_diff:.3g}"
                            f" (tolerance {tolerance:g})")
    kind = "bit-identical" if tolerance == 0 else f"within {tolerance:g}"
    as_cold = sum(compare_outputs(r, c).same_tokens for r, c in zip(report.recompute, served))
    if problems:
        report.add("same outputs", False, "; ".join(problems))
    else:
        report.add("same outputs", True, f"{len(served)}/{len(served)} completions as from "
                   f"vLLM's own cache: same tokens, logprobs {kind} (max |diff| {worst:.3g}); "
                   f"same tokens as the cold pass {as_cold}/{len(served)}")


def _check_cached(served: list[Completion], report: CheckReport) -> bool:
    if any(c.cached_tokens is None for c in served):
        return report.add("cached tokens", False, "the server reports no usage."
                          "prompt_tokens_details: start it with --enable-prompt-tokens-details")
    cacheable = [cacheable_tokens(c.prompt_tokens, report.block_size) for c in served]
    short = [f"prompt {i}: {c.cached_tokens} < {want}"
             for i, (c, want) in enumerate(zip(served, cacheable)) if c.cached_tokens < want]
    got = sum(c.cached_tokens for c in served)
    if short:
        return report.add("cached tokens", False, "cached tokens do not cover the cacheable "
                          "prefix: " + "; ".join(short))
    return report.add("cached tokens", True, f"{got} cached of {sum(cacheable)} cacheable "
                      f"prompt tokens")


def _settled_metrics(client: ServingClient, before: ServerMetrics,
                     served: list[Completion]) -> ServerMetrics:
    """Scrape until the counters have caught up with the requests (or a deadline passes)."""
    sent = sum(c.prompt_tokens for c in served)
    deadline = time.monotonic() + _METRICS_WAIT_S
    while True:
        after = client.metrics()
        caught_up = after.offload.query_tokens - before.offload.query_tokens >= sent
        if caught_up or time.monotonic() > deadline:
            time.sleep(0.5)  # and anything recorded a moment later is counted too
            return client.metrics()
        time.sleep(0.2)


def _check_metrics(before: ServerMetrics, after: ServerMetrics, served: list[Completion],
                   report: CheckReport) -> None:
    delta = after.offload.since(before.offload)
    report.counters = delta
    local = after.local_hit_tokens - before.local_hit_tokens
    external = after.external_hit_tokens - before.external_hit_tokens
    cached = sum(c.cached_tokens for c in served)
    sent = sum(c.prompt_tokens for c in served)
    facts: list[tuple[str, Callable[[], bool]]] = [
        (f"hit tokens +{delta.hit_tokens:g} (host {delta.hit_tokens_host:g}, "
         f"{after.storage_tier or 'storage'} {delta.hit_tokens_storage:g}) = cached {cached} "
         f"- vLLM's own hits {local:g}",
         lambda: delta.hit_tokens == cached - local),
        # Without a reset (a replay), vLLM's own cache could serve everything: not the point.
        ("kv-offload served some of them", lambda: delta.hit_tokens > 0),
        (f"vLLM's connector hit tokens +{external:g}", lambda: external == delta.hit_tokens),
        (f"query tokens +{delta.query_tokens:g} = prompt tokens sent {sent}",
         lambda: delta.query_tokens == sent),
        (f"failed load blocks +{delta.failed_load_blocks:g}",
         lambda: delta.failed_load_blocks == 0),
        (f"loaded bytes +{delta.loaded_bytes:g}",
         lambda: (delta.loaded_bytes > 0) == (delta.hit_tokens > 0)),
    ]
    wrong = [text for text, holds in facts if not holds()]
    if wrong:
        report.add("metrics agree", False, "does not hold: " + "; ".join(wrong))
    else:
        report.add("metrics agree", True, "; ".join(text for text, _ in facts))
