"""Requests that run a LoRA adapter are neither looked up nor stored.

An adapter changes the KV of every layer it touches, and vLLM keys a request's blocks by the
adapter's name (`lora_name` in the block hash's extra keys), not its content: an adapter
loaded again under the same name with other weights (vLLM's `/v1/load_lora_adapter`, a
restart over a retrained adapter) would be served the old adapter's KV. kv-offload does not
identify adapters by content, so their requests stay out of every tier; vLLM's own prefix
cache still serves them within the engine. Driven by vLLM's real Scheduler
(`real_scheduler_harness`)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from helpers.real_scheduler_harness import (  # noqa: E402
    MAX_TOKENS,
    PROMPT,
    forget_in_engine,
    scheduled_new,
    stored,
)
from helpers.real_scheduler_harness import engines as engines_fixture  # noqa: E402,F401
from helpers.real_scheduler_harness import (  # noqa: E402,F401  (fixture)
    in_step_engine as in_step_engine_fixture,
)
from helpers.real_scheduler_harness import llama_dir as llama_dir_fixture  # noqa: E402,F401


def run_with_adapter(engine, req_id: str, adapter: str):
    request = Request(req_id, list(PROMPT), SamplingParams(max_tokens=MAX_TOKENS), None,
                      lora_request=LoRARequest(adapter, 1, f"/adapters/{adapter}"),
                      block_hasher=engine.block_hasher)
    engine.scheduler.add_request(request)
    return request, engine.step_until(lambda s: request.is_finished(), f"{req_id} finished")


def test_a_request_with_an_adapter_stores_nothing_and_is_served_nothing(in_step_engine):
    engine = in_step_engine
    _, first = run_with_adapter(engine, "A", "support-bot")
    assert stored(first) == []
    forget_in_engine(engine)
    again, steps = run_with_adapter(engine, "B", "support-bot")  # (the same name)
    new = next(scheduled_new(s, "B") for s in steps if scheduled_new(s, "B"))
    assert new.num_computed_tokens == 0  # recomputed, not served from our tiers
    assert not any(s.meta.loads for s in steps)
    assert len(again.output_token_ids) == MAX_TOKENS


def test_the_same_prompt_without_an_adapter_is_still_stored_and_served(in_step_engine):
    engine = in_step_engine
    _, first = engine.run_to_completion("A")
    assert stored(first)
    forget_in_engine(engine)
    _, steps = engine.run_to_completion("B")
    new = next(scheduled_new(s, "B") for s in steps if scheduled_new(s, "B"))
    assert new.num_computed_tokens > 0
