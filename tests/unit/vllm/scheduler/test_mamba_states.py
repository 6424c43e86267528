"""Mamba-type states through OffloadScheduler, driven by vLLM 0.32's real KV-cache manager in
prefix-caching "align" mode, for every Mamba-type backend vLLM has (short-conv and Mamba1
do not run end to end on vLLM CPU; Mamba2 and GatedDeltaNet also run in
tests/e2e/test_mamba_hybrids.py). No engine is started: vLLM's `KVCacheManager` allocates
the blocks, nulls and offers the states (`take_boundary_state_offloads`) exactly as its
scheduler does, and our scheduler consumes them through the same calls the connector makes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.sched.output import KVConnectorBlockState  # noqa: E402

from kv_offload.vllm.spec_translation import translate_groups  # noqa: E402

from helpers.vllm_scheduler_helpers import (  # noqa: E402
    ATTN,
    BLOCK,
    NewRequestData,
    OffloadScheduler,
    cached_step,
    hashes_of,
    output,
    report,
    request_factory,
    stored,
    vkv,
)

MAMBA_TYPES = ["SHORT_CONV", "MAMBA1", "MAMBA2", "GDN_ATTN", "LINEAR"]
ATTN_GROUP, STATE_GROUP = 0, 1


def kv_cache_config(mamba_type: str) -> vkv.KVCacheConfig:
    state = vkv.MambaSpec(block_size=BLOCK, shapes=((3, 64), (4, 16)),
                          dtypes=(torch.bfloat16, torch.float32), page_size_padded=8192,
                          mamba_type=MambaAttentionBackendEnum[mamba_type],
                          mamba_cache_mode="align")
    return vkv.KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[],
        kv_cache_groups=[vkv.KVCacheGroupSpec(["attn"], vkv.FullAttentionSpec(**ATTN)),
                         vkv.KVCacheGroupSpec(["state"], state)])


def engine(mamba_type: str) -> tuple[KVCacheManager, OffloadScheduler]:
    """vLLM's manager (a fresh prefix cache) and our scheduler over the same config."""
    config = kv_cache_config(mamba_type)
    manager = KVCacheManager(config, max_model_len=1024, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK, enable_caching=True)
    sched = OffloadScheduler([g.spec for g in translate_groups(config)], BLOCK, 1)
    report(sched, 0)  # the only rank has reported: lookups are answered
    return manager, sched


def prefill(manager: KVCacheManager, sched: OffloadScheduler, request, chunk: int = BLOCK):
    """Schedule the request's prompt in `chunk`-token steps the way vLLM's scheduler does;
    per step: (vLLM's offers, our metadata)."""
    rid = request.request_id
    sched.num_new_matched_tokens(request, 0)
    computed, _, *_ = manager.get_computed_blocks(request)
    steps, before = [], None
    while request.num_computed_tokens < request.num_tokens:
        n = min(chunk, request.num_tokens - request.num_computed_tokens)
        manager.allocate_slots(request, n, new_computed_blocks=computed if before is None
                               else None)
        ids = manager.get_block_ids(rid)
        offers = manager.take_boundary_state_offloads()
        if before is None:
            out = output(new=[NewRequestData.from_request(request, ids)], scheduled={rid: n})
        else:  # the attention table is append-only; ours ignores the state group's table
            out = output(cached=cached_step(request, tuple(
                list(now[len(was):]) for now, was in zip(ids, before))), scheduled={rid: n})
        out.kv_connector_block_state = KVConnectorBlockState(
            req_ids={rid}, resolve_block_ids=manager.get_block_ids,
            boundary_state_offloads=offers)
        steps.append((offers.get(rid, []), sched.build_meta(out)))
        before = [list(group) for group in ids]
        request.num_computed_tokens += n
    return steps


@pytest.mark.parametrize("mamba_type", MAMBA_TYPES)
def test_stores_exactly_the_states_vllm_offers(mamba_type):
    manager, sched = engine(mamba_type)
    request = request_factory()("r", 100)
    steps = prefill(manager, sched, request)
    offered = [offer for offers, _ in steps for offer in offers]
    assert [tokens for _, _, tokens in offered] == [32, 64, 96]  # a state per boundary
    for offers, meta in steps:
        assert stored(meta, STATE_GROUP) == [
            (bytes(request.block_hashes[tokens // BLOCK - 1]), block_id)
            for group, block_id, tokens in offers if group == STATE_GROUP]
    attention = [key for _, meta in steps for key in stored(meta, ATTN_GROUP)]
    assert [h for h, _ in attention] == hashes_of(request, [0, 1, 2])  # unchanged behaviour


@pytest.mark.parametrize("mamba_type", MAMBA_TYPES)
def test_a_state_block_vllm_nulls_later_was_copied_in_its_own_step(mamba_type):
    """vLLM nulls the block of the state at 32 tokens two steps later (align mode keeps
    only the states it retains): it was planned in the step that offered it, whose copy
    runs after that step's forward, before vLLM can reuse the block."""
    manager, sched = engine(mamba_type)
    request = request_factory()("r", 100)
    steps = prefill(manager, sched, request)
    (first_state,) = steps[0][0]
    assert manager.get_block_ids("r")[STATE_GROUP][0] == 0  # nulled by now
    assert stored(steps[0][1], STATE_GROUP) == [(bytes(request.block_hashes[0]),
                                                 first_state[1])]


@pytest.mark.parametrize("mamba_type", MAMBA_TYPES)
def test_a_hit_loads_the_state_where_vllm_reads_it(mamba_type):
    """After vLLM's cache is gone, a longer prompt sharing the first one hits at the last
    boundary with a stored state (96: every attention block and the state at 96); the load
    writes that state into the block vLLM allocated at index 96/32 - 1, which is the block
    vLLM's Mamba manager then resumes from."""
    manager, sched = engine(mamba_type)
    make = request_factory()
    first = make("a", 100)
    steps = prefill(manager, sched, first)
    held = [(h, g) for _, meta in steps for g, (hashes, _) in meta.stores.items()
            for h in hashes]
    report(sched, 0, held, reflected_step=steps[-1][1].step)  # every store reported
    fresh, _ = engine(mamba_type)  # vLLM after reset_prefix_cache(): nothing local
    longer = make("b", 150)  # the same first 100 tokens, then more
    assert fresh.get_computed_blocks(longer)[1] == 0
    tokens, load_async, _ = sched.num_new_matched_tokens(longer, 0)
    assert (tokens, load_async) == (96, True)
    fresh.allocate_slots(longer, 0, num_external_computed_tokens=96, delay_cache_blocks=True)
    ids = fresh.get_block_ids("b")
    sched.after_alloc(longer, ids, 96)
    meta = sched.build_meta(output())
    plan = meta.loads["b"]
    state_block = ids[STATE_GROUP][96 // BLOCK - 1]
    assert state_block != 0
    assert plan[STATE_GROUP] == ([bytes(longer.block_hashes[2])], [state_block])
    assert plan[ATTN_GROUP] == (hashes_of(longer, [0, 1, 2]), ids[ATTN_GROUP][:3])
    # The load finished: vLLM schedules the rest and resumes from the loaded state.
    longer.num_computed_tokens = 96
    fresh.allocate_slots(longer, 54)
    resumed = fresh.coordinator.single_type_managers[STATE_GROUP]
    assert resumed.last_state_block_idx["b"] == 96 // BLOCK - 1
    assert fresh.get_block_ids("b")[STATE_GROUP][96 // BLOCK - 1] == state_block


@pytest.mark.parametrize("mamba_type", MAMBA_TYPES)
def test_no_hit_past_the_last_stored_state(mamba_type):
    """Attention blocks up to 128 are stored but the state at 128 is not: the hit stops at
    96, the last boundary every group can serve."""
    manager, sched = engine(mamba_type)
    make = request_factory()
    first = make("a", 140)
    steps = prefill(manager, sched, first)
    held = [(h, g) for _, meta in steps for g, (hashes, _) in meta.stores.items()
            for h in hashes if not (g == STATE_GROUP and h == bytes(first.block_hashes[3]))]
    assert (bytes(first.block_hashes[3]), ATTN_GROUP) in held
    report(sched, 0, held, reflected_step=steps[-1][1].step)  # every store reported
    tokens, _, _ = sched.num_new_matched_tokens(make("b", 200), 0)
    assert tokens == 96


@pytest.mark.parametrize("mamba_type", ["MAMBA2", "GDN_ATTN"])
def test_a_step_reusing_a_state_block_still_being_copied_waits_for_the_copy(mamba_type):
    """vLLM frees state blocks of running requests (the state at 32 is nulled two steps
    later) and may hand one to another request while our copy of it is still in flight:
    that step's forward must wait for the stores; once the workers report the copy done,
    reusing the block needs no wait."""
    manager, sched = engine(mamba_type)
    make = request_factory()
    first = make("a", 100)
    steps = prefill(manager, sched, first)
    (offer,) = steps[0][0]
    reused = offer[1]
    assert manager.get_block_ids("a")[STATE_GROUP][0] == 0  # vLLM freed it
    other = make("b", 40, first_token=500)
    sched.num_new_matched_tokens(other, 0)
    ids = ([40], [reused])  # vLLM hands the freed block to another request
    meta = sched.build_meta(output(new=[NewRequestData.from_request(other, ids)],
                                   scheduled={"b": 40}))
    assert meta.wait_for_stores
    report(sched, 0, reflected_step=meta.step)  # every copy so far is out
    third = make("c", 40, first_token=700)
    sched.num_new_matched_tokens(third, 0)
    meta = sched.build_meta(output(new=[NewRequestData.from_request(third, ([41], [reused]))],
                                   scheduled={"c": 40}))
    assert not meta.wait_for_stores
