"""Prefill/decode disaggregation through a shared store, on vLLM's real Scheduler.

Two engines (`real_scheduler_harness`: vLLM's own Scheduler and KV-cache manager, a played
model runner over a real worker-role connector) share one disk directory whose background
rescan is off (an hour), so only the targeted `find` the connector sends can show one
engine what the other stored. The prefill engine (`kv_producer`) runs the request with
`max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true}` as a proxy sends it;
what vLLM puts in its output's `kv_transfer_params` goes with the same request to the decode
engine (`kv_consumer`), which waits for the promised blocks, loads them, and recomputes
only the rest. Also: a promise nobody keeps ends at `remote_wait_s` (recomputed), other
requests run meanwhile, and an engine that was idle sees what another stored.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from kv_offload.vllm.pd_params import PARAMS_KEY  # noqa: E402

from helpers.real_scheduler_harness import (  # noqa: E402
    FULL_BLOCKS,
    HIT_TOKENS,
    PROMPT,
    scheduled_new,
    stored,
)
from helpers.real_scheduler_harness import engines as engines_fixture  # noqa: E402,F401
from helpers.real_scheduler_harness import llama_dir as llama_dir_fixture  # noqa: E402,F401


@pytest.fixture
def shared_dir(tmp_path):
    return {"cpu_bytes_to_use": 8 << 20, "storage_tier": "filesystem",
            "storage_options": {"root_dir": str(tmp_path / "kv"), "bytes_to_use": "64MiB",
                                "rescan_interval_s": 3600}}


def stats_of(engine) -> dict[str, float]:
    """The scheduler side's counters as vLLM takes them each step (summed from now on)."""
    connector, totals = engine.scheduler.connector, {}
    take = connector.get_kv_connector_stats

    def spy():
        stats = take()
        for name, value in (stats.data.items() if stats is not None else ()):
            totals[name] = totals.get(name, 0) + value
        return stats

    connector.get_kv_connector_stats = spy
    return totals


def prefill(engine, req_id: str = "P"):
    request = engine.add(req_id, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    steps = engine.step_until(lambda s: request.is_finished(), f"{req_id} finished")
    assert engine.runner.worker.store.flush()  # (the bytes are on disk: not what is tested)
    return request, steps


def first_scheduled(steps, req_id):
    return next(scheduled_new(s, req_id) for s in steps if scheduled_new(s, req_id))


def test_a_decode_engine_loads_what_the_prefill_engine_promised(engines, shared_dir):
    d = engines(shared_dir, role="kv_consumer")  # (first: its start-up scan finds nothing)
    counts = stats_of(d)
    p = engines(shared_dir, role="kv_producer")
    p.step()  # (an empty step: the ranks report their identity, which the promise names)
    request, p_steps = prefill(p)
    params = p.transfer_params["P"]
    assert params[PARAMS_KEY]["tokens"] == HIT_TOKENS  # every whole block but the last token
    assert params[PARAMS_KEY]["identity"] == p.runner.worker.identity != ""
    p_bytes = p.runner.block_bytes(p.runner.requests["P"].block_ids[:FULL_BLOCKS])
    assert len(stored(p_steps)) >= FULL_BLOCKS

    decode = d.add("D", kv_transfer_params=params)
    steps = d.step_until(lambda s: decode.is_finished(), "D finished")
    new = first_scheduled(steps, "D")
    assert new.num_computed_tokens == HIT_TOKENS  # served, not recomputed
    assert any(s.meta.find for s in steps)  # (it asked the store for the promised keys)
    d_bytes = d.runner.block_bytes(d.runner.requests["D"].block_ids[:FULL_BLOCKS])
    assert all(map(torch.equal, d_bytes, p_bytes))
    assert stored(steps) == []  # a consumer stores nothing
    assert counts.get("remote_waits") == 1 and not counts.get("remote_deadlines_missed")


def test_a_promise_nobody_keeps_ends_at_its_deadline_while_others_run(engines, tmp_path,
                                                                      shared_dir):
    d = engines({**shared_dir, "remote_wait_s": 0.5}, role="kv_consumer")
    counts = stats_of(d)
    identity = d.runner.worker.identity
    d.step()  # (the ranks report their identity)
    broken = {PARAMS_KEY: {"version": 1, "tokens": HIT_TOKENS, "identity": identity}}
    waiting = d.add("W", kv_transfer_params=broken)
    other = d.add("O", prompt=[t + 1 for t in PROMPT])
    started = time.monotonic()
    steps = d.step_until(lambda s: waiting.is_finished(), "W finished")
    assert first_scheduled(steps, "W").num_computed_tokens == 0  # recomputed whole
    assert time.monotonic() - started >= 0.5
    ran_while_waiting = [s for s in steps if "O" in s.output.num_scheduled_tokens and
                         "W" not in s.output.num_scheduled_tokens]
    assert ran_while_waiting  # other requests are not held up by the wait
    assert other.num_computed_tokens > 0
    assert counts.get("remote_deadlines_missed") == 1


def test_a_promise_of_another_model_or_layout_is_not_waited_for(engines, shared_dir):
    d = engines({**shared_dir, "remote_wait_s": 30}, role="kv_consumer")
    d.step()
    foreign = {PARAMS_KEY: {"version": 1, "tokens": HIT_TOKENS, "identity": "not-ours"}}
    request = d.add("F", kv_transfer_params=foreign)
    started = time.monotonic()
    d.step_until(lambda s: request.is_finished(), "F finished")
    assert time.monotonic() - started < 10


def test_a_producer_serves_no_hits_of_its_own(engines, shared_dir):
    p = engines(shared_dir, role="kv_producer")
    prefill(p, "P1")
    assert p.scheduler.reset_prefix_cache()
    again = p.add("P2")
    steps = p.step_until(lambda s: again.is_finished(), "P2 finished")
    assert first_scheduled(steps, "P2").num_computed_tokens == 0
    assert not any(s.meta.loads for s in steps)


def test_an_engine_that_was_idle_finds_what_another_stored(engines, shared_dir):
    idle = engines(shared_dir)  # started first: its view saw nothing
    busy = engines(shared_dir)
    busy.run_to_completion("A")
    assert busy.runner.worker.store.flush()
    time.sleep(0.6)  # (idle for longer than IDLE_S; no step ran)
    request = idle.add("B")
    steps = idle.step_until(lambda s: request.is_finished(), "B finished")
    assert first_scheduled(steps, "B").num_computed_tokens == HIT_TOKENS


@pytest.mark.parametrize("mode", ["when_idle", "always"])
def test_a_busy_engine_finds_what_another_stored_when_it_asks_always(engines, shared_dir,
                                                                      mode):
    """Busy: a long request keeps the engine stepping. Its view never refreshes (an hour),
    so only asking the store finds what the other engine stored: with 'always' the first
    lookup asks and waits a step or two; with 'when_idle' a busy engine does not ask."""
    busy = engines({**shared_dir, "find_on_lookup": mode})
    other = engines(shared_dir)
    other.run_to_completion("A")
    assert other.runner.worker.store.flush()
    busy.add("long", max_tokens=200, prompt=[t + 5 for t in PROMPT])
    busy.step_until(lambda s: "long" in s.output.num_scheduled_tokens, "long ran")
    for _ in range(3):  # (it runs: every step has a forward)
        assert "long" in busy.step().output.num_scheduled_tokens
    busy.add("B")
    steps = busy.step_until(lambda s: "B" in s.output.num_scheduled_tokens, "B ran")
    served = first_scheduled(steps, "B").num_computed_tokens
    assert served == (HIT_TOKENS if mode == "always" else 0)
    assert any(s.meta.find for s in steps) == (mode == "always")
