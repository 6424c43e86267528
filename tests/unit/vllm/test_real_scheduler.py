"""vLLM's own Scheduler drives the connector's scheduler side; the test plays the model runner.

Real: vLLM's `Scheduler`, built from vLLM's config classes over a tiny local Llama
(`build_llama`, no download) and the `KVCacheConfig` vLLM's own planning gives one CPU worker.
It creates `KVOffloadConnector` from `kv_transfer_config`, asks it for hits, parks requests in
WAITING_FOR_REMOTE_KVS, takes its metadata every step and hands it the workers' output. The
worker side is a worker-role `KVOffloadConnector` built by its own constructor (in vLLM's
parallel groups of one process), with its `OffloadWorker` (host tier, threads), on caches laid
out as vLLM allocates them (`allocate_kv_caches`).

Played: vLLM's model runner, making the worker-role connector's calls in vLLM's order; each
step's result goes back to vLLM as a real `ModelRunnerOutput` with a `KVConnectorOutput`.
The "forward" computes nothing: it writes bytes derived from (layer, token id, position) into
each scheduled token's slot and samples a fixed word, so loaded bytes can be told from
anything else.

Scenario: A runs to completion and its full blocks are stored; vLLM's prefix cache is reset
and engine memory overwritten; B with A's prompt hits in our connector, waits for its load,
then runs with every full block but the last token's computed, holding A's bytes; after
`reset_prefix_cache(reset_connector=True)` C with the same prompt misses.
"""
# ruff: noqa: E402  (vLLM is imported only once importorskip found it)

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
import vllm
from vllm.v1.request import RequestStatus

from kv_offload.testing.tiny_vocab import VOCAB_SIZE
from kv_offload.vllm.connector import KVOffloadConnector

from helpers.real_scheduler_harness import (
    ASYNC_ONLY,
    FULL_BLOCKS,
    HIT_TOKENS,
    IN_STEP,
    MAX_TOKENS,
    NUM_BLOCKS,
    PROMPT,
    PROMPT_LEN,
    Engine,
    Step,
    expected_bytes,
    forget_in_engine,
    scheduled_new,
    stored,
)
from helpers.real_scheduler_harness import engines as engines_fixture  # noqa: F401  (fixture)
from helpers.real_scheduler_harness import in_step_engine as in_step_engine_fixture  # noqa: F401  (fixture)
from helpers.real_scheduler_harness import llama_dir as llama_dir_fixture  # noqa: F401  (fixture)


@pytest.fixture
def engine(engines):
    return engines(ASYNC_ONLY)


def test_vllm_runs_a_request_whose_full_blocks_the_connector_stores(engine):
    print(f"vLLM {vllm.__version__} from {vllm.__file__}")  # (shown with -rP)
    assert isinstance(engine.scheduler.get_kv_connector(), KVOffloadConnector)
    assert engine.scheduler.recompute_kv_load_failures
    a, steps = engine.run_to_completion("A")
    # Until the worker's first report our connector cannot answer (vLLM asks again): the
    # first step runs no forward and only carries that report back.
    assert steps[0].output.total_num_scheduled_tokens == 0
    assert steps[0].states["A"] == (RequestStatus.WAITING, 0)
    prefill = steps[1]
    first = scheduled_new(prefill, "A")
    assert first is not None and first.num_computed_tokens == 0
    assert prefill.output.num_scheduled_tokens["A"] == PROMPT_LEN
    # The prefill's forward completed 6 blocks (the 7th is partial): those are stored, once.
    a_blocks = first.block_ids[0][:FULL_BLOCKS]
    assert stored([prefill]) == list(zip(map(bytes, a.block_hashes[:FULL_BLOCKS]), a_blocks))
    assert stored(steps) == stored([prefill])
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(a.output_token_ids) == MAX_TOKENS
    assert all(torch.equal(got, want) for got, want in
               zip(engine.runner.block_bytes(a_blocks), expected_bytes(PROMPT, FULL_BLOCKS)))


def test_a_request_with_astored_prefix_waits_for_its_load_then_runs_from_the_hit(engine):
    engine.run_to_completion("A")
    a_bytes = engine.runner.block_bytes(engine.runner.requests["A"].block_ids[:FULL_BLOCKS])
    forget_in_engine(engine)
    b = engine.add("B")
    asked = engine.step_until(lambda s: s.states["B"][0] != RequestStatus.WAITING,
                              "B looked up")[-1]
    steps = engine.step_until(lambda s: "B" in s.output.num_scheduled_tokens, "B ran")

    # Our connector's hit: vLLM allocates B's blocks, counts the hit as computed (before it
    # arrives) and parks B until the load reports back; the plan reaches the worker then.
    assert asked.states["B"] == (RequestStatus.WAITING_FOR_REMOTE_KVS, HIT_TOKENS)
    assert "B" not in asked.output.num_scheduled_tokens
    ((hashes, b_blocks),) = asked.meta.loads["B"].values()
    assert hashes == [bytes(h) for h in b.block_hashes[:FULL_BLOCKS]]

    # The worker reported the load finished, once; vLLM then ran B from the hit on, in the
    # blocks the load filled: all full blocks, never the last prompt token.
    assert sum("B" in s.finished_recving for s in [asked, *steps]) == 1
    ran = scheduled_new(steps[-1], "B")
    assert ran is not None and ran.num_computed_tokens == HIT_TOKENS
    assert ran.block_ids[0][:FULL_BLOCKS] == b_blocks
    assert steps[-1].output.num_scheduled_tokens["B"] == PROMPT_LEN - HIT_TOKENS
    # The forward wrote only from the hit on: B's full blocks hold what the load put there.
    assert all(map(torch.equal, engine.runner.block_bytes(b_blocks), a_bytes))
    engine.step_until(lambda s: b.is_finished(), "B finished")
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(b.output_token_ids) == MAX_TOKENS
    assert not stored(steps)  # the worker holds B's full blocks already: none stored again


def test_after_vllm_resets_the_connector_the_same_prompt_misses(engine):
    engine.run_to_completion("A")
    forget_in_engine(engine)
    _, b_steps = engine.run_to_completion("B")
    assert any("B" in s.meta.loads for s in b_steps)  # (B hit, as in the test above)

    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    c = engine.add("C")
    steps = engine.step_until(lambda s: "C" in s.output.num_scheduled_tokens, "C ran")
    # C misses: vLLM computes it from scratch, nothing is loaded.
    ran = scheduled_new(steps[-1], "C")
    assert ran is not None and ran.num_computed_tokens == 0
    assert steps[-1].output.num_scheduled_tokens["C"] == PROMPT_LEN
    assert not any("C" in s.meta.loads for s in steps)
    assert c.status == RequestStatus.RUNNING
    # The reset went to the worker with the next step's metadata, and C's lookup waited
    # until the worker reported it done (no answer from copies being dropped).
    reset_at = [i for i, s in enumerate(steps) if s.meta.reset]
    assert len(reset_at) == 1 and reset_at[0] < len(steps) - 1


def test_a_host_hit_loads_inside_the_step_that_runs_its_request(in_step_engine):
    engine = in_step_engine
    engine.run_to_completion("A")
    a_bytes = engine.runner.block_bytes(engine.runner.requests["A"].block_ids[:FULL_BLOCKS])
    forget_in_engine(engine)
    b = engine.add("B")
    steps = engine.step_until(lambda s: "B" in s.output.num_scheduled_tokens, "B ran")
    # No extra step: the step that plans B's load runs B's prefill from the hit, after the
    # worker finished the load (vLLM calls start_load_kv before that forward).
    ran = steps[-1]
    assert not any(s.states["B"][0] == RequestStatus.WAITING_FOR_REMOTE_KVS for s in steps)
    assert ran.output.has_sync_kv_loads and ran.meta.in_step == ["B"]
    new = scheduled_new(ran, "B")
    assert new is not None and new.num_computed_tokens == HIT_TOKENS
    assert ran.output.num_scheduled_tokens["B"] == PROMPT_LEN - HIT_TOKENS
    ((hashes, b_blocks),) = ran.meta.loads["B"].values()
    assert hashes == [bytes(h) for h in b.block_hashes[:FULL_BLOCKS]]
    assert all(map(torch.equal, engine.runner.block_bytes(b_blocks), a_bytes))
    assert not any("B" in s.finished_recving for s in steps)  # (not a request-level load)
    engine.step_until(lambda s: b.is_finished(), "B finished")
    assert len(b.output_token_ids) == MAX_TOKENS


def test_an_in_step_load_that_fails_is_recomputed_by_vllm_from_the_bad_block(in_step_engine):
    engine = in_step_engine
    engine.run_to_completion("A")
    forget_in_engine(engine)
    b = engine.add("B")
    while True:  # step by hand: drop our host tier between vLLM's plan and the forward
        output = engine.scheduler.schedule()
        if "B" in output.kv_connector_metadata.in_step:
            engine.runner.worker.reset()  # every key gone: the load fails whole
        runner_output = engine.execute(output)
        if "B" in output.num_scheduled_tokens:
            break
    b_blocks = engine.runner.requests["B"].block_ids[:FULL_BLOCKS]
    assert runner_output.kv_connector_output.invalid_block_ids == set(b_blocks)  # by block
    assert b.num_computed_tokens == 0 and not b.output_token_ids  # rewound, token dropped
    steps = engine.step_until(lambda s: b.is_finished(), "B finished")
    assert steps[0].output.num_scheduled_tokens["B"] == PROMPT_LEN  # recomputed whole
    assert len(b.output_token_ids) == MAX_TOKENS
    assert all(map(torch.equal, engine.runner.block_bytes(b_blocks),
                   expected_bytes(PROMPT, FULL_BLOCKS)))


def _fill_all_but(engine: Engine, keep: list[int]) -> None:
    """Every block except `keep` gets a value the played forward never writes."""
    others = [b for b in range(NUM_BLOCKS) if b not in keep]
    for cache in engine.runner.caches.values():
        cache[others] = 1000.0


def _prefill_a_then_forget_in_vllm(engine: Engine) -> tuple[list[int], Step]:
    """A runs to its end in its prefill step; vLLM then forgets its own copy at once,
    before any step carries the workers' report of A's stores back."""
    a = engine.add("A", max_tokens=1)
    steps = engine.step_until(lambda s: a.is_finished(), "A finished")
    a_blocks = scheduled_new(steps[-1], "A").block_ids[0][:FULL_BLOCKS]
    assert stored(steps[-1:]) == list(zip(map(bytes, a.block_hashes[:FULL_BLOCKS]), a_blocks))
    assert engine.scheduler.reset_prefix_cache()
    return a_blocks, steps[-1]


def test_a_request_right_after_the_one_that_stored_its_prefix_loads_it_in_step(engines):
    """The step after A's prefill, B (same prompt) hits on the stores the scheduler
    planned for A, before any report says they landed: the worker's in-step load waits for
    A's store copy and B's prefill runs in that very step (before: B waited a step for the
    report)."""
    engine = engines(IN_STEP)
    # Only the engine's own calls move copies now (no pump thread): A's store is still in
    # flight, not even in a host slot, when the workers report after A's step.
    engine.runner.worker._pump.stop()
    a_blocks, _ = _prefill_a_then_forget_in_vllm(engine)
    _fill_all_but(engine, a_blocks)
    b = engine.add("B")
    ran = engine.step()
    assert "B" in ran.output.num_scheduled_tokens  # the first step B was seen in
    assert ran.output.has_sync_kv_loads and ran.meta.in_step == ["B"]
    new = scheduled_new(ran, "B")
    assert new is not None and new.num_computed_tokens == HIT_TOKENS
    b_blocks = new.block_ids[0][:FULL_BLOCKS]
    assert not set(b_blocks) & set(a_blocks)  # (filled above: only the load wrote them)
    assert ran.states["B"][0] != RequestStatus.WAITING_FOR_REMOTE_KVS
    assert all(map(torch.equal, engine.runner.block_bytes(b_blocks),
                   expected_bytes(PROMPT, FULL_BLOCKS)))
    engine.step_until(lambda s: b.is_finished(), "B finished")
    assert len(b.output_token_ids) == MAX_TOKENS


def test_when_the_store_a_hit_counted_on_fails_the_request_is_recomputed(engines):
    """As above, but A's store is abandoned (its copies discarded): B's in-step load of
    those keys fails by block and vLLM recomputes B; no stale byte is served."""
    engine = engines(IN_STEP)
    engine.runner.worker._pump.stop()
    a_blocks, _ = _prefill_a_then_forget_in_vllm(engine)
    engine.runner.worker.abandon_stores()
    _fill_all_but(engine, a_blocks)
    b = engine.add("B")
    ran = engine.step()
    assert ran.meta.in_step == ["B"]  # (the hit counted on the planned store)
    b_blocks = engine.runner.requests["B"].block_ids[:FULL_BLOCKS]
    steps = engine.step_until(lambda s: b.is_finished(), "B finished")
    assert steps[0].output.num_scheduled_tokens["B"] == PROMPT_LEN  # recomputed whole
    assert all(map(torch.equal, engine.runner.block_bytes(b_blocks),
                   expected_bytes(PROMPT, FULL_BLOCKS)))
    assert len(b.output_token_ids) == MAX_TOKENS


OTHER_PROMPT = [4 + (i * 53 + 11) % (VOCAB_SIZE - 4) for i in range(PROMPT_LEN)]


def test_a_disk_hit_loads_in_step_once_the_rank_has_measured_its_reads(engines, tmp_path):
    """A new engine over a disk directory another engine filled: its first disk hit loads
    asynchronously (no read measured yet) and measures the read; the next disk hit, well
    within `in_step_read_s`, is read inside the step that runs it."""
    disk = {**IN_STEP, "storage_tier": "filesystem",
            "storage_options": {"root_dir": str(tmp_path / "kv"), "bytes_to_use": 64 << 20},
            "in_step_read_s": 5.0}  # (a generous budget: this machine is shared)
    first = engines(disk)
    first.run_to_completion("A")
    first.run_to_completion("A2", prompt=OTHER_PROMPT)
    first.runner.worker.shutdown()  # finishes the write-through to disk
    engine = engines(disk)  # a new process: only the files remain
    ours = engine.scheduler.get_kv_connector()._scheduler
    engine.step_until(lambda s: ours.num_keys >= 2 * FULL_BLOCKS, "the disk inventory known")
    b = engine.add("B")
    steps = engine.step_until(lambda s: "B" in s.output.num_scheduled_tokens, "B ran")
    assert any(s.states["B"][0] == RequestStatus.WAITING_FOR_REMOTE_KVS for s in steps)
    assert not any(s.meta.in_step for s in steps)  # asynchronous: no figure yet
    engine.step_until(lambda s: b.is_finished(), "B finished")
    c = engine.add("C", prompt=OTHER_PROMPT)
    steps = engine.step_until(lambda s: "C" in s.output.num_scheduled_tokens, "C ran")
    ran = steps[-1]
    assert ran.meta.in_step == ["C"] and ran.output.has_sync_kv_loads
    assert not any(s.states["C"][0] == RequestStatus.WAITING_FOR_REMOTE_KVS for s in steps)
    new = scheduled_new(ran, "C")
    assert new is not None and new.num_computed_tokens == HIT_TOKENS
    c_blocks = new.block_ids[0][:FULL_BLOCKS]
    assert all(map(torch.equal, engine.runner.block_bytes(c_blocks),
                   expected_bytes(OTHER_PROMPT, FULL_BLOCKS)))
    engine.step_until(lambda s: c.is_finished(), "C finished")
    assert len(c.output_token_ids) == MAX_TOKENS
