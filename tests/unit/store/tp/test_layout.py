"""The head shard of a rank is the one vLLM 0.32 loads, and every head is written once.

vLLM's own `QKVParallelLinear` weight loader is the reference: its K rows are marked with
their global head index and loaded for a given parallel shape (the shape getters are set to
that shape: one process cannot form a real T-rank group here); the heads that land on the
rank are read back from the loaded weight.
"""

from __future__ import annotations

import pytest
import torch

from kv_offload.errors import ConfigError
from kv_offload.specs import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec
from kv_offload.store.tp.layout import KVHeadShard, TPMode, group_shard, tp_mode

SHAPES = [(8, 1), (8, 2), (8, 4), (8, 8), (2, 1), (2, 2), (2, 4), (2, 8), (1, 1), (1, 8),
          (16, 8), (4, 8), (32, 4)]


def vllm_loaded_heads(monkeypatch, total: int, tp: int, rank: int) -> list[int]:
    linear = pytest.importorskip("vllm.model_executor.layers.linear")
    parameter = pytest.importorskip("vllm.model_executor.parameter")
    for module in (linear, parameter):
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: tp)
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
    head_size = 2
    layer = linear.QKVParallelLinear(hidden_size=4, head_size=head_size,
                                     total_num_heads=max(8, tp), total_num_kv_heads=total,
                                     bias=False)
    marked = torch.arange(total).repeat_interleave(head_size)[:, None].float().expand(-1, 4)
    layer.weight_loader(layer.weight, marked.contiguous(), "k")
    start = layer.num_heads * head_size
    rows = layer.weight.data[start:start + layer.num_kv_heads * head_size, 0]
    return [int(head) for head in rows[::head_size]]


@pytest.mark.parametrize(("total", "tp"), SHAPES)
def test_a_rank_holds_the_heads_vllm_loads_onto_it(monkeypatch, total, tp):
    for rank in range(tp):
        shard = KVHeadShard.of(total, tp, rank)
        assert list(shard.heads) == vllm_loaded_heads(monkeypatch, total, tp, rank)


@pytest.mark.parametrize(("total", "tp"), SHAPES)
def test_every_head_is_written_by_exactly_one_rank_and_read_by_every_rank_holding_it(total, tp):
    shards = [KVHeadShard.of(total, tp, rank) for rank in range(tp)]
    written = [head for shard in shards for head in shard.units_written()]
    assert sorted(written) == list(range(total))
    for shard in shards:
        assert list(shard.units_needed()) == list(shard.heads)
        assert shard.num_heads == max(1, total // tp)  # vLLM's get_num_kv_heads


@pytest.mark.parametrize(("total", "tp"), [(6, 4), (3, 2), (6, 8), (12, 8)])
def test_a_head_count_vllm_cannot_shard_is_refused_like_vllm_refuses_it(monkeypatch, total, tp):
    with pytest.raises(ConfigError, match=f"{total} KV heads"):
        KVHeadShard.of(total, tp, 0)
    with pytest.raises(AssertionError, match="not divisible"):
        vllm_loaded_heads(monkeypatch, total, tp, 0)


def test_bad_shard_arguments_are_config_errors_naming_them():
    with pytest.raises(ConfigError, match="rank"):
        KVHeadShard.of(8, 2, 2)
    with pytest.raises(ConfigError, match="tp_size"):
        KVHeadShard.of(8, 0, 0)


def test_attention_is_stored_by_head_mla_once_and_mamba_per_tp_shape():
    common = dict(block_size=16, head_size=64, dtype=torch.bfloat16)
    assert tp_mode(FullAttentionSpec(num_kv_heads=4, **common)) is TPMode.HEADS
    assert tp_mode(SlidingWindowSpec(num_kv_heads=4, sliding_window=64, **common)) \
        is TPMode.HEADS
    mla = MLAAttentionSpec(num_kv_heads=1, **common)
    assert tp_mode(mla) is TPMode.REPLICATED
    assert [group_shard(mla, 1, 8, rank).writes for rank in range(8)] == [True] + [False] * 7
    mamba = MambaSpec(block_size=16, shapes=((3, 64),), dtypes=(torch.bfloat16,))
    assert tp_mode(mamba) is TPMode.PER_SHAPE and group_shard(mamba, 8, 2, 0) is None


def test_a_spec_whose_head_count_disagrees_with_vllms_rule_is_refused():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="num_kv_heads=4"):
        group_shard(spec, 8, 4, 0)  # vLLM would give 2 heads per rank
