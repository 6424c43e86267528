"""vLLM's own Scheduler and a real worker-role connector (`real_scheduler_harness`) when an
in-step load's copy thread stalls and the load is given up at `copy_timeout_s`: the copy
may still write the request's blocks once its thread runs again, so those blocks go to no
other request before it has ended. Both ways vLLM lets go of blocks are covered: a request
that ends (vLLM holds its blocks until every rank reported it back) and a request vLLM
preempts (it frees the blocks at once; the step that reuses one waits before its forward).
The stall is a copy share held by the test (`Stall`), as a thread the OS does not run.
"""
# ruff: noqa: E402  (vLLM is imported only once importorskip found it)

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import threading
import time

import torch

from kv_offload.testing.tiny_vocab import VOCAB_SIZE

from helpers.real_scheduler_harness import (
    FULL_BLOCKS,
    HIT_TOKENS,
    IN_STEP,
    MAX_TOKENS,
    PROMPT_LEN,
    forget_in_engine,
    scheduled_new,
)
from helpers.real_scheduler_harness import engines as engines_fixture  # noqa: F401  (fixture)
from helpers.real_scheduler_harness import in_step_engine as in_step_engine_fixture  # noqa: F401  (fixture)
from helpers.real_scheduler_harness import llama_dir as llama_dir_fixture  # noqa: F401  (fixture)
from unit.store.host.test_cpu_backend_stalled_copies import Stall


def test_a_request_ending_while_its_given_up_in_step_load_may_still_copy_keeps_its_blocks(
        engines, monkeypatch):
    """B's in-step host load stalls (its copy thread is held at its start, as a thread the
    OS does not run): the worker gives it up at `copy_timeout_s` and vLLM recomputes B,
    which then ends while that copy could still write B's blocks. vLLM keeps those blocks
    (B stays in its requests, the blocks referenced) until the copy ended and the worker
    reported B in `finished_recving`; only then are they free for another request."""
    engine = engines({**IN_STEP, "copy_timeout_s": 0.3})
    engine.run_to_completion("A")
    forget_in_engine(engine)
    stall = Stall(monkeypatch)  # (the next copy share to start: B's load)
    b = engine.add("B")
    steps = engine.step_until(lambda s: b.is_finished(), "B finished")
    loaded = next(s for s in steps if s.meta.in_step == ["B"])
    assert stall.held.is_set()
    assert loaded.output.num_scheduled_tokens["B"] == PROMPT_LEN - HIT_TOKENS
    assert any(s.output.num_scheduled_tokens.get("B") == PROMPT_LEN for s in steps)  # redone
    assert len(b.output_token_ids) == MAX_TOKENS
    b_blocks = scheduled_new(loaded, "B").block_ids[0]
    pool = engine.scheduler.kv_cache_manager.block_pool
    for _ in range(3):  # the copy is still held: B's blocks stay B's
        step = engine.step()
        assert "B" in engine.scheduler.requests and "B" not in step.finished_recving
        assert all(pool.blocks[i].ref_cnt > 0 for i in b_blocks)
    stall.release()
    steps = engine.step_until(lambda s: "B" in s.finished_recving, "B reported back")
    assert "B" not in engine.scheduler.requests
    assert all(pool.blocks[i].ref_cnt == 0 for i in b_blocks)  # free for anyone now


LONG_PROMPT_LEN = 880  # 28 blocks, 16 tokens short of a 29th


def test_a_step_that_reuses_a_preempted_requests_blocks_waits_for_its_given_up_load(
        engines, monkeypatch):
    """B's in-step host load stalls and is given up; B is recomputed, then preempted while
    that copy could still write B's blocks. vLLM frees a preempted request's blocks at once,
    so the first step that hands one of them to another request waits, before its forward,
    until the copy ended: the worker-role connector's `handle_preemptions` waits, and the
    bytes the forward then writes there stay (without the wait, the copy would land after
    them and the other request would read A's bytes). The stalled copy is one whose thread
    was already inside its copy when the load was given up: it writes once it runs again."""
    engine = engines({**IN_STEP, "copy_timeout_s": 0.3})
    engine.run_to_completion("A")
    forget_in_engine(engine)
    stall = Stall(monkeypatch, inside_op=True)  # (the next copy share to start: B's load)
    # X and Y take every block B leaves (63 of the pool's 64 are usable: vLLM keeps one as
    # its null block); 16 tokens into their decode they need one more, and vLLM preempts B.
    for i, req_id in enumerate(("X", "Y")):
        engine.add(req_id, max_tokens=100, prompt=[
            4 + (k * (59 + i) + 7) % (VOCAB_SIZE - 4) for k in range(LONG_PROMPT_LEN)])
    engine.add("B", max_tokens=100)
    loaded = engine.step()
    assert loaded.meta.in_step == ["B"] and stall.held.is_set()
    b_loaded = set(scheduled_new(loaded, "B").block_ids[0][:FULL_BLOCKS])
    release = threading.Timer(1.0, stall.release)
    for _ in range(40):
        output = engine.scheduler.schedule()
        new_ids = output.scheduled_cached_reqs.new_block_ids
        reused = {i for ids in new_ids if ids is not None for i in ids[0]} & b_loaded
        if reused:
            break
        engine.execute(output)
    else:
        raise AssertionError("no step reused a block of B's given-up load")
    assert "B" in output.preempted_req_ids
    assert output.kv_connector_metadata.wait_for_loads
    release.start()
    started = time.monotonic()
    engine.execute(output)
    assert time.monotonic() - started >= 0.8  # the forward waited for the release
    slots = [pair for block_id in reused
             for pair in engine.runner.slots_written(output, block_id)]
    engine.runner.worker.wait_for_given_up_loads()  # (the copy has landed, if it had not)
    assert slots and all(torch.equal(got, want) for got, want in slots)
    release.join()


def test_a_request_that_ends_in_the_step_of_its_in_step_load_frees_its_blocks_at_once(
        in_step_engine):
    """The step that loads B's hit runs B's prefill, and B (one token) ends in it, before
    any report of that step came back: nothing of that load can still copy (it succeeded:
    vLLM would have rewound B otherwise), so vLLM frees B's blocks at once, and an offline
    benchmark's `reset_prefix_cache()` right after it works."""
    engine = in_step_engine
    engine.run_to_completion("A")
    forget_in_engine(engine)
    b = engine.add("B", max_tokens=1)
    ran = engine.step()
    assert ran.meta.in_step == ["B"] and b.is_finished()
    assert "B" not in engine.scheduler.requests  # freed with its end
    assert engine.scheduler.reset_prefix_cache()
