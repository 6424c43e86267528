"""Online serving: vLLM's OpenAI-compatible server with KVOffloadConnector, real clients.

Three servers are started as the README tells CPU users to start them
(`python -m vllm.entrypoints.openai.api_server ... --kv-transfer-config ...`, on a free
loopback port, VLLM_SERVER_DEV_MODE=1, `--enable-prompt-tokens-details`), one after the other:

  baseline   no connector, no dev mode: the reference completions (greedy, top-5 logprobs),
             computed (cold) and then served by vLLM's own prefix cache (the same prompts again);
  first      the connector over a host tier and a disk directory: a cold pass, then
             `POST /reset_prefix_cache` and the same prompts again; `kv-offload serve-check`
             run against it twice (`--record`);
  restarted  a new server over the same disk directory: the prompts again (only the disk can
             serve them), `serve-check --replay` of both records — one of them after its
             files were given other blocks' bytes under valid headers (a planted bug the
             check must catch).

The official `openai` client talks to them; every server is stopped with SIGTERM and must
exit with no engine process left behind (by pid). Teardown kills each process group even when
a step fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from disk_tamper import give_other_blocks_bytes
from engine_harness import cacheable_prefix

from kv_offload.serving.client import Completion, ResetResult, ServingClient, compare_outputs
from kv_offload.serving.metrics import OffloadCounters, ServerMetrics
from kv_offload.serving.server import ServerSettings, ShutdownReport, VllmServer
from kv_offload.testing.tiny_vocab import word_prompt

pytestmark = pytest.mark.e2e

MAX_TOKENS, LOGPROBS, BLOCK = 8, 5, 32
# Longer than one block, not multiples of it; the first request of a server is long (on AMX
# CPUs a first prompt of a few tokens kills vLLM's CPU worker with SIGILL).
PROMPTS = [word_prompt(150), word_prompt(70, offset=200), word_prompt(260, offset=400)]
CHECK_PROMPTS = {"r1": 2, "r2": 1}  # serve-check --record runs: prompts of CHECK_TOKENS
CHECK_TOKENS = 200


@dataclass
class CliRun:
    returncode: int
    stdout: str
    report: dict[str, Any]

    def check(self, name: str) -> dict[str, Any]:
        return next(c for c in self.report["checks"] if c["name"] == name)


@dataclass
class Scenario:
    page_bytes: int
    baseline: list[Completion] = field(default_factory=list)
    baseline_cached: list[Completion] = field(default_factory=list)
    check_without_connector: CliRun | None = None
    cold: list[Completion] = field(default_factory=list)
    reset: ResetResult | None = None
    warm: list[Completion] = field(default_factory=list)
    cold_counters: OffloadCounters | None = None
    warm_metrics: tuple[ServerMetrics, ServerMetrics] | None = None
    checks: dict[str, CliRun] = field(default_factory=dict)
    tampered_files: list[Path] = field(default_factory=list)
    restarted: list[Completion] = field(default_factory=list)
    restarted_counters: OffloadCounters | None = None
    shutdowns: dict[str, ShutdownReport] = field(default_factory=dict)


def connector_config(fs_root: Path) -> dict[str, Any]:
    return {
        "kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kv_offload.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_bytes_to_use": "64MiB", "storage_tier": "filesystem",
                                      "storage_options": {"root_dir": str(fs_root),
                                                          "bytes_to_use": "256MiB"}},
    }


def page_bytes(model_dir: Path) -> int:
    """KV bytes of one block of the model: what the connector moves per block."""
    config = json.loads((model_dir / "config.json").read_text())
    head = config["hidden_size"] // config["num_attention_heads"]
    return (config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head * BLOCK
            * 2)  # K and V, bfloat16


def complete_all(client: ServingClient) -> list[Completion]:
    return [client.complete(p, max_tokens=MAX_TOKENS, logprobs=LOGPROBS) for p in PROMPTS]


def serve_check(url: str, work: Path, name: str, *args: str) -> CliRun:
    out = work / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kv_offload.tools.cli", "serve-check", url, "--json", str(out),
         "--timeout-s", "60", *args],
        cwd=work, capture_output=True, text=True, timeout=180)
    report = json.loads(out.read_text())["results"] if out.exists() else {}
    return CliRun(proc.returncode, proc.stdout + proc.stderr, report)


def settled(client: ServingClient, before: ServerMetrics, ready: Any) -> ServerMetrics:
    """Scrape /metrics until `ready(delta)` holds (stats reach the front end a bit after the
    outputs, stores finish in the background); the last scrape if it never does."""
    deadline = time.monotonic() + 30
    while True:
        after = client.metrics()
        if ready(after.offload.since(before.offload)) or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def disk_files(root: Path) -> set[Path]:
    return set(root.rglob("*.safetensors"))


def wait_for_files(root: Path, count: int) -> set[Path]:
    """The disk tier's files once at least `count` exist (write-through is asynchronous)."""
    deadline = time.monotonic() + 30
    while len(files := disk_files(root)) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    return files


@pytest.fixture(scope="module")
def scenario(tiny_models, tmp_path_factory) -> Scenario:
    work = tmp_path_factory.mktemp("serving")
    model = str(tiny_models["llama"])
    fs_root = work / "kv"
    result = Scenario(page_bytes=page_bytes(tiny_models["llama"]))

    # (no dev mode: serve-check against it must name both missing preconditions at once)
    with VllmServer(ServerSettings(model=model, dev_mode=False), work,
                    name="baseline") as server:
        with ServingClient(server.url) as client:
            result.baseline = complete_all(client)
            result.baseline_cached = complete_all(client)
        result.check_without_connector = serve_check(server.url, work, "check-baseline")
        result.shutdowns["baseline"] = server.stop()

    offload = ServerSettings(model=model, kv_transfer_config=connector_config(fs_root))
    cacheable_blocks = sum(cacheable_prefix(len(p.split())) for p in PROMPTS) // BLOCK
    with VllmServer(offload, work, name="first") as server:
        with ServingClient(server.url) as client:
            start = client.metrics()
            result.cold = complete_all(client)
            after_cold = settled(client, start, lambda d: d.stored_bytes >= cacheable_blocks
                                 * result.page_bytes)
            result.cold_counters = after_cold.offload.since(start.offload)
            result.reset = client.reset_prefix_cache()
            before = client.metrics()
            result.warm = complete_all(client)
            sent = sum(c.prompt_tokens for c in result.warm)
            after = settled(client, before, lambda d: d.query_tokens >= sent)
            result.warm_metrics = (before, after)
        check_blocks = (CHECK_TOKENS - 1) // BLOCK
        prompt_files = wait_for_files(fs_root, cacheable_blocks)
        result.checks["record r1"] = serve_check(
            server.url, work, "record-r1", "--record", str(work / "r1.json"),
            "--prompts", str(CHECK_PROMPTS["r1"]), "--prompt-tokens", str(CHECK_TOKENS))
        # Wait for r1's files, so that the files new after r2's run are exactly r2's. (Each
        # run also sends one throwaway prompt of the same length first: its "server flags".)
        r1_files = wait_for_files(fs_root, len(prompt_files)
                                  + (CHECK_PROMPTS["r1"] + 1) * check_blocks)
        result.checks["record r2"] = serve_check(
            server.url, work, "record-r2", "--record", str(work / "r2.json"),
            "--prompts", str(CHECK_PROMPTS["r2"]), "--prompt-tokens", str(CHECK_TOKENS))
        result.shutdowns["first"] = server.stop()  # flushes the write-through to disk

    result.tampered_files = sorted(disk_files(fs_root) - r1_files)
    assert len(result.tampered_files) == (CHECK_PROMPTS["r2"] + 1) * check_blocks, \
        "r2's files could not be told apart"
    give_other_blocks_bytes(result.tampered_files, sorted(r1_files - prompt_files))

    with VllmServer(offload, work, name="restarted") as server:
        with ServingClient(server.url) as client:
            before = client.metrics()
            result.restarted = complete_all(client)
            sent = sum(c.prompt_tokens for c in result.restarted)
            after = settled(client, before, lambda d: d.query_tokens >= sent)
            result.restarted_counters = after.offload.since(before.offload)
        result.checks["replay r1"] = serve_check(server.url, work, "replay-r1",
                                                 "--replay", str(work / "r1.json"))
        result.checks["replay r2"] = serve_check(server.url, work, "replay-r2",
                                                 "--replay", str(work / "r2.json"))
        result.shutdowns["restarted"] = server.stop()
    return result


def cacheable(completions: list[Completion]) -> list[int]:
    return [cacheable_prefix(c.prompt_tokens) for c in completions]


def cached(completions: list[Completion]) -> list[int]:
    return [c.cached_tokens for c in completions]


def test_completions_through_the_connector_are_identical_to_a_server_without_it(scenario):
    """Like for like, tokens and top-5 logprobs at every position as exact floats: computed
    prompts against computed prompts, and prefixes loaded by kv-offload (from host memory,
    from disk after a restart) against prefixes served by vLLM's own prefix cache. (A prefix
    from a cache is continued by a short prefill, which may round differently in the last
    bits than one long prefill: vLLM's own cache does the same.)"""
    assert [c.prompt_tokens for c in scenario.baseline] == [len(p.split()) for p in PROMPTS]
    assert all(len(c.tokens) == MAX_TOKENS for c in scenario.baseline)
    assert cached(scenario.baseline_cached) == cacheable(scenario.baseline_cached)
    passes = {"cold": (scenario.baseline, scenario.cold),
              "warm": (scenario.baseline_cached, scenario.warm),
              "restarted": (scenario.baseline_cached, scenario.restarted)}
    differences = [
        f"{name} prompt {i}: {compare_outputs(ref, got)}"
        for name, (reference, served) in passes.items()
        for i, (ref, got) in enumerate(zip(reference, served, strict=True))
        if (ref.tokens, ref.top_logprobs) != (got.tokens, got.top_logprobs)
    ]
    assert differences == []
    # And the greedy tokens are those of the computed prompts, whatever served the prefix.
    for served in (scenario.baseline_cached, scenario.warm, scenario.restarted):
        assert [c.tokens for c in served] == [c.tokens for c in scenario.baseline]


def test_after_a_cache_reset_cached_tokens_cover_each_prompts_cacheable_prefix(scenario):
    assert cached(scenario.cold) == [0, 0, 0]
    assert scenario.reset is ResetResult.RESET
    assert cached(scenario.warm) == cacheable(scenario.warm)


def test_prometheus_counters_agree_with_what_the_clients_saw(scenario):
    page = scenario.page_bytes
    cold = scenario.cold_counters
    assert cold.query_tokens == sum(c.prompt_tokens for c in scenario.cold)
    assert cold.hit_tokens == 0
    assert cold.stored_bytes == sum(cacheable(scenario.cold)) // BLOCK * page
    before, after = scenario.warm_metrics
    warm = after.offload.since(before.offload)
    hits = sum(cached(scenario.warm))
    assert after.local_hit_tokens - before.local_hit_tokens == 0  # vLLM's cache was reset
    assert (warm.hit_tokens_host, warm.hit_tokens_storage) == (hits, 0)
    assert after.external_hit_tokens - before.external_hit_tokens == hits
    assert warm.query_tokens == sum(c.prompt_tokens for c in scenario.warm)
    assert warm.loaded_bytes == hits // BLOCK * page
    assert warm.failed_load_blocks == warm.failed_store_blocks == 0


def test_a_restarted_server_over_the_same_disk_directory_serves_from_disk(scenario):
    restarted = scenario.restarted_counters
    assert cached(scenario.restarted) == cacheable(scenario.restarted)
    assert (restarted.hit_tokens_host, restarted.hit_tokens_storage) == (
        0, sum(cached(scenario.restarted)))
    assert restarted.loaded_bytes == sum(cached(scenario.restarted)) // BLOCK * scenario.page_bytes
    assert restarted.failed_load_blocks == 0


def test_every_server_shuts_down_cleanly_leaving_no_engine_process(scenario):
    assert set(scenario.shutdowns) == {"baseline", "first", "restarted"}
    for name, report in scenario.shutdowns.items():
        # API server, engine core, worker (and multiprocessing's resource tracker).
        assert len(report.pids) >= 3, f"{name}: the engine processes were not seen"
        assert report.exit_code == 0, f"{name}: {report}"
        assert report.leftover_pids == () and not report.killed, f"{name}: {report}"
        assert report.seconds < 60


def test_serve_check_passes_against_the_connector_and_after_a_restart(scenario):
    for name in ("record r1", "record r2", "replay r1"):
        run = scenario.checks[name]
        assert run.returncode == 0, f"{name}:\n{run.stdout}"
        assert run.report["passed"] is True
        assert {c["name"]: c["passed"] for c in run.report["checks"]}["same outputs"] is True
    recorded = scenario.checks["record r1"].report
    assert [c["name"] for c in recorded["checks"]] == [
        "server", "connector", "server flags", "prompts", "cold pass", "vLLM cache pass",
        "reset", "same outputs", "cached tokens", "metrics agree", "healthy after"]
    assert recorded["prompt_tokens"] == [CHECK_TOKENS] * CHECK_PROMPTS["r1"]
    assert recorded["counters"]["hit_tokens_host"] == sum(
        c["cached_tokens"] for c in recorded["served"])
    replayed = scenario.checks["replay r1"].report
    disk_hits = (CHECK_TOKENS - 1) // BLOCK * BLOCK * CHECK_PROMPTS["r1"]
    assert (replayed["counters"]["hit_tokens_host"],
            replayed["counters"]["hit_tokens_storage"]) == (0, disk_hits)


def test_serve_check_names_every_missing_precondition_before_sending_a_prompt(scenario):
    run = scenario.check_without_connector  # (no connector, no VLLM_SERVER_DEV_MODE=1)
    assert run.returncode == 1
    assert run.check("connector")["passed"] is False
    assert "KVOffloadConnector" in run.check("connector")["detail"]
    flags = run.check("server flags")
    assert flags["passed"] is False
    assert "VLLM_SERVER_DEV_MODE=1" in flags["detail"]
    assert "prompt_tokens_details" not in flags["detail"]  # (that server reports them)
    assert [c["name"] for c in run.report["checks"]] == ["server", "connector", "server flags"]
    assert run.report["recompute"] == []


def test_serve_check_catches_a_disk_tier_that_serves_another_blocks_bytes(scenario):
    """The planted bug: r2's files hold r1's blocks under valid headers. The tier serves them
    (every check of its own passes), so the cached tokens look right — only the outputs
    show it."""
    assert scenario.tampered_files
    run = scenario.checks["replay r2"]
    assert run.returncode == 1, run.stdout
    assert run.check("same outputs")["passed"] is False
    assert "differ" in run.check("same outputs")["detail"]
    assert run.check("cached tokens")["passed"] is True
