"""DeepSeek-V4.1's bounded-replay groups on vLLM's real Scheduler (0.32 and 0.33) with our
connector: a full-attention group beside a `SlidingWindowMLASpec(bounded_replay=True)`
group. vLLM recomputes a hit's last window for a replay group unless the connector says its
load restored it, and drops a hit no longer than that window (`Scheduler.schedule`:
`_load_restores_replay_window`, `_mark_prefix_replay`). We never store nor load a replay
group, never claim it, and report only hits vLLM takes in full.

Only the scheduler side runs here (no forward): the workers' reports that say which keys
they hold are played with `report`, and a step's result is a sampled token per request
that finished its prompt, and the loads that finished. (Hits on a model of several groups
load asynchronously: `InStepLoads` takes single-group models only.)"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import dataclasses  # noqa: E402

import torch  # noqa: E402
from vllm.v1 import kv_cache_interface as vkv  # noqa: E402

if "bounded_replay" not in {f.name for f in dataclasses.fields(vkv.SlidingWindowMLASpec)}:
    pytest.skip("this vLLM has no bounded-replay groups (no SlidingWindowMLASpec."
                "bounded_replay; DeepSeek-V4.1's replay groups)", allow_module_level=True)

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kv_offload.vllm.connector import KVOffloadConnector  # noqa: E402

from helpers.real_scheduler_harness import (  # noqa: E402,F401
    BLOCK,
    IN_STEP,
    PROMPT,
    VLLM_033,
    llama_dir,
    vllm_config_for,
)
from helpers.vllm_scheduler_helpers import keys, report  # noqa: E402

WINDOW = 64  # the replay group's sliding window: vLLM replays this many tokens of a hit
FULL, REPLAYED = 0, 1  # group ids
HIT = (len(PROMPT) - 1) // BLOCK * BLOCK  # 192: whole blocks, never the last token


def kv_cache_config() -> vkv.KVCacheConfig:
    """Full attention (2 heads) beside a bounded-replay MLA window, pages of 8 KiB each."""
    full = vkv.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                                 dtype=torch.bfloat16)
    replayed = vkv.SlidingWindowMLASpec(block_size=BLOCK, num_kv_heads=1, head_size=128,
                                        dtype=torch.bfloat16, sliding_window=WINDOW,
                                        bounded_replay=True)
    assert replayed.prefix_replay_tokens == WINDOW and not replayed.prefix_cacheable
    config = vkv.KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[],
        kv_cache_groups=[vkv.KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full),
                         vkv.KVCacheGroupSpec(["model.layers.1.self_attn.attn"], replayed)])
    config.hash_block_size = BLOCK
    return config


class Engine:
    """vLLM's real Scheduler (it builds our scheduler-side connector itself)."""

    def __init__(self, model_dir, extra: dict) -> None:
        vllm_config = vllm_config_for(model_dir, extra)
        register_all_kvcache_specs(vllm_config)
        config = kv_cache_config()
        vllm_config.cache_config.num_gpu_blocks = config.num_blocks
        self.scheduler = Scheduler(
            vllm_config=vllm_config, kv_cache_config=config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK, hash_block_size=BLOCK, log_stats=True)
        self.connector = self.scheduler.connector
        assert isinstance(self.connector, KVOffloadConnector)
        self.offload = self.connector._scheduler
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        kv_cache_utils.init_none_hash(hash_fn)
        # vLLM 0.33's EngineCore also passes its hash look-ahead (0 here); 0.32 has none.
        lookahead = (vllm_config.num_hash_lookahead_tokens,) if VLLM_033 else ()
        self.hasher = kv_cache_utils.get_request_block_hasher(BLOCK, hash_fn, *lookahead)
        report(self.offload, 0, [])  # the only rank has reported: lookups answer

    def request(self, req_id: str) -> Request:
        return Request(req_id, list(PROMPT), SamplingParams(max_tokens=2), None,
                       block_hasher=self.hasher)

    def step(self, loaded: set[str] = frozenset()):
        """One step: (vLLM's plan, the tokens vLLM took from the connector in it). Each
        request that reached the end of its prompt samples a token; `loaded`: the requests
        whose loads the workers finished."""
        output = self.scheduler.schedule()
        taken = self.scheduler.connector_prefix_cache_stats.hits  # (reset by the update)
        sampled = {}
        for req_id in output.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            sampled[req_id] = [7] if request.num_computed_tokens >= request.num_tokens else []
        req_ids = list(sampled)
        self.scheduler.update_from_output(output, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids],
            kv_connector_output=KVConnectorOutput(finished_recving=set(loaded))))
        return output, taken


@pytest.fixture(name="engine")
def engine_fixture(llama_dir):  # noqa: F811
    return Engine(llama_dir, IN_STEP)


def test_a_model_with_a_bounded_replay_group_starts_and_never_claims_it(engine):
    assert engine.connector.get_loaded_kv_cache_group_ids(engine.request("r")) == (FULL,)


def test_a_hit_longer_than_the_window_is_taken_in_full_and_the_window_replayed(engine):
    request = engine.request("r")
    report(engine.offload, 0, keys(request, range(HIT // BLOCK), group=FULL))
    reported, load_async = engine.connector.get_num_new_matched_tokens(request, 0)
    assert reported == HIT  # the full-attention prefix: the replayed group does not bound it
    engine.scheduler.add_request(request)
    output, taken = engine.step()
    assert taken == reported and load_async  # vLLM took every token we reported ...
    assert request.num_computed_tokens == HIT
    # ... and our load writes the full-attention blocks only: never the replayed group's.
    loads = output.kv_connector_metadata.loads["r"]
    assert list(loads) == [FULL]
    assert loads[FULL][0] == [key for key, _ in keys(request, range(HIT // BLOCK))]
    # Once the blocks arrived vLLM recomputes the hit's last window (the replayed group's
    # KV; the loaded full-attention KV of those tokens is kept), and the rest of the prompt.
    engine.step(loaded={"r"})
    output, _ = engine.step()
    new = output.scheduled_new_reqs[0]
    assert (new.num_computed_tokens, new.replay_start) == (HIT - WINDOW, HIT - WINDOW)
    assert output.num_scheduled_tokens["r"] == len(PROMPT) - (HIT - WINDOW)


@pytest.mark.parametrize("cached_blocks", [1, WINDOW // BLOCK])
def test_a_hit_no_longer_than_the_window_is_not_reported_as_vllm_would_drop_it(
        engine, cached_blocks):
    request = engine.request("r")
    report(engine.offload, 0, keys(request, range(cached_blocks), group=FULL))
    assert engine.connector.get_num_new_matched_tokens(request, 0) == (0, False)
    engine.scheduler.add_request(request)
    output, taken = engine.step()
    assert taken == 0
    assert "r" not in output.kv_connector_metadata.loads
    assert output.num_scheduled_tokens["r"] == len(PROMPT)


def test_the_replayed_groups_blocks_are_never_stored(engine):
    request = engine.request("r")
    engine.scheduler.add_request(request)
    stores: dict[int, list[bytes]] = {}
    for _ in range(4):
        meta = engine.step()[0].kv_connector_metadata
        for group, (hashes, _) in meta.stores.items():
            stores.setdefault(group, []).extend(hashes)
    assert list(stores) == [FULL]
    assert stores[FULL] == [key for key, _ in keys(request, range(HIT // BLOCK))]
