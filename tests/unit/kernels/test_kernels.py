"""Batched CPU copies: every example model and layout, bit for bit, against a
per-page reference that reads the canonical refs directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_offload import (
    FullAttentionSpec,
    KVCacheGroup,
    MambaSpec,
    SlidingWindowSpec,
    canonicalize,
)
from kv_offload.errors import TransferError
from kv_offload.kernels import BlockCopier, Direction, HostSlotLayout, copy_blocks
from kv_offload.kernels import plan as plan_kernels
from kv_offload.kernels.cpu import CpuCopier, Op, _shares
from kv_offload.kernels.plan import argsort_ids
from kv_offload.testing.engine_alloc import (
    LAYOUTS,
    allocate_kv_caches,
    legacy_mamba_states,
    legacy_split_kv,
)
from kv_offload.testing.example_models import EXAMPLE_MODELS, build_example

STRATEGIES = ["runs", "rows", "gather", "scatter", "staged"]


def randomize(tensor: torch.Tensor, seed: int) -> None:
    """Fill an int8 tensor with random bytes (drawn 8 at a time: big pools are slow)."""
    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**63, 2**63 - 1, (-(-tensor.numel() // 8),), dtype=torch.int64,
                          generator=gen)
    tensor.copy_(words.view(torch.int8)[:tensor.numel()].view(tensor.shape))


def engine_page(canonical, ref, block: int) -> torch.Tensor:
    return canonical.tensors[ref.tensor_idx].tensor[block, ref.offset_bytes:
                                                    ref.offset_bytes + ref.page_size_bytes]


def slot_offsets(canonical, group: int) -> list[int]:
    """The documented slot layout: the group's refs' slot_bytes back to back."""
    return np.cumsum([0] + [r.slot_bytes for r in canonical.group_refs[group]])[:-1].tolist()


def reference_store(canonical, pool: torch.Tensor, transfers) -> torch.Tensor:
    expected = pool.clone()
    for g, (blocks, slots) in transfers.items():
        for b, s in zip(blocks, slots):
            for ref, off in zip(canonical.group_refs[g], slot_offsets(canonical, g)):
                expected[s, off:off + ref.page_size_bytes] = engine_page(canonical, ref, b)
    return expected


def reference_load(canonical, pool: torch.Tensor, transfers, buffer: torch.Tensor):
    """The engine buffer after the load, computed page by page on a copy."""
    saved = buffer.clone()
    for g, (blocks, slots) in transfers.items():
        for b, s in zip(blocks, slots):
            for ref, off in zip(canonical.group_refs[g], slot_offsets(canonical, g)):
                engine_page(canonical, ref, b).copy_(pool[s, off:off + ref.page_size_bytes])
    expected = buffer.clone()
    buffer.copy_(saved)
    return expected


def round_trip(kv_caches, groups, num_blocks, buffer, seed=0, strategy=None, blocks_per_group=3,
               threads=None, streaming=False):
    """Store some blocks of every group, scribble, load them into other blocks;
    compare pool and whole engine buffer with the page-by-page reference."""
    rng = np.random.default_rng(seed)
    canonical = canonicalize(kv_caches, groups, num_blocks)
    layout = HostSlotLayout.from_canonical(canonical)
    num_slots = len(groups) * blocks_per_group + 3
    pool = torch.empty(num_slots, layout.slot_bytes, dtype=torch.int8)
    randomize(pool, seed + 1)
    randomize(buffer, seed + 2)
    copier = BlockCopier(canonical, pool, layout)
    if threads or streaming:  # split every job into shares, however small; stream rows
        copier._cpu = CpuCopier(copier.segments, threads=threads, split_bytes=0,
                                stream_bytes=0 if streaming else 1 << 62)
    # A block id belongs to one group at a time: disjoint blocks per group, out of order.
    blocks = rng.permutation(num_blocks)[:len(groups) * blocks_per_group]
    slots = rng.permutation(num_slots)[:blocks.size]
    per_group = {g: (blocks[g::len(groups)].tolist(), slots[g::len(groups)].tolist())
                 for g in range(len(groups))}
    expected_pool = reference_store(canonical, pool, per_group)
    moved = copier.copy(copier.plan(Direction.STORE, per_group), strategy)
    assert moved == sum(canonical.data_bytes_per_block(g) * len(per_group[g][0])
                        for g in per_group)
    assert torch.equal(pool, expected_pool)

    randomize(buffer, seed + 3)  # scribble over the engine
    targets = rng.permutation(num_blocks)[:blocks.size]
    loads = {g: (targets[g::len(groups)].tolist(), per_group[g][1]) for g in per_group}
    expected = reference_load(canonical, pool, loads, buffer)
    copier.copy(copier.plan(Direction.LOAD, loads), strategy)
    assert torch.equal(buffer, expected)  # loaded bytes right, all other bytes untouched
    assert torch.equal(pool, expected_pool)  # a load leaves the host side alone
    return canonical


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(EXAMPLE_MODELS))
def test_example_models_round_trip(name, layout):
    big = name in ("qwen3-next", "deepseek-mla")  # 13 and 4.4 MB per block: keep them few
    model = build_example(name, 4 if big else 7, layout=layout)
    round_trip(model.kv_caches, model.groups, model.num_blocks, model.buffer, seed=len(name),
               blocks_per_group=1 if big else 3)


def small_hybrid(layout: str, num_blocks: int):
    """Attention + padded Mamba groups overlaying one buffer, like qwen3-next but small."""
    attn = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=64, shapes=((3, 100), (2, 8, 8)), dtypes=(torch.bfloat16,) * 2,
                      page_size_padded=attn.page_size_bytes)
    groups = [KVCacheGroup(["a0", "a1"], attn), KVCacheGroup(["m0", "m1"], mamba),
              KVCacheGroup(["m2", "m3"], mamba)]
    buffer, caches = allocate_kv_caches(groups, num_blocks, layout)
    return caches, groups, buffer


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
@pytest.mark.parametrize("strategy", STRATEGIES + ["rows, streaming"])
def test_every_strategy_on_hybrid_padded_model(strategy, layout, threads):
    caches, groups, buffer = small_hybrid(layout, 12)
    streaming = strategy.endswith("streaming")
    canonical = round_trip(caches, groups, 12, buffer, strategy=strategy.split(",")[0],
                           threads=threads, streaming=streaming)
    assert any(r.slot_bytes > r.page_size_bytes for refs in canonical.group_refs for r in refs)


@pytest.mark.parametrize("kv_outer", [True, False])
def test_legacy_split_kv(kv_outer):
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16)
    caches = legacy_split_kv(spec, 9, 3, kv_outer=kv_outer)
    groups = [KVCacheGroup(list(caches), spec)]
    for seed, cache in enumerate(caches.values()):
        round_trip({n: c for n, c in caches.items() if c is cache}, [
            KVCacheGroup([n for n, c in caches.items() if c is cache], spec)], 9,
            cache.view(-1).view(torch.int8), seed=seed)
    assert len(canonicalize(caches, groups, 9).group_refs[0]) == (6 if kv_outer else 3)


def test_legacy_mamba_state_lists_with_padding():
    spec = MambaSpec(block_size=1, shapes=((3, 40), (4, 8, 8)), dtypes=(torch.float16,) * 2,
                     page_size_padded=1024)
    buffer, caches = legacy_mamba_states(spec, 8, 2)
    round_trip(caches, [KVCacheGroup(list(caches), spec)], 8, buffer)


def test_padded_attention_pages_reserve_but_do_not_copy_padding():
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16,
                             page_size_padded=200)
    groups = [KVCacheGroup(["a", "b"], spec)]
    buffer, caches = allocate_kv_caches(groups, 5, "LBNHC")
    canonical = round_trip(caches, groups, 5, buffer)
    assert HostSlotLayout.from_canonical(canonical).slot_bytes == 400


def test_groups_with_different_slot_sizes_share_the_pool():
    attn = FullAttentionSpec(block_size=8, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=8, num_kv_heads=2, head_size=16, dtype=torch.bfloat16,
                            sliding_window=64)
    groups = [KVCacheGroup(["f0", "f1", "f2"], attn), KVCacheGroup(["s0"], swa)]
    buffer, caches = allocate_kv_caches(groups, 10, "LBNHC")
    canonical = round_trip(caches, groups, 10, buffer)
    layout = HostSlotLayout.from_canonical(canonical)
    assert layout.group_bytes == (3 * attn.page_size_bytes, swa.page_size_bytes)
    assert layout.slot_bytes == 3 * attn.page_size_bytes


def test_segments_fuse_layers_of_one_buffer():
    model = build_example("llama-8b", 4, layout="LBNHC")
    canonical = canonicalize(model.kv_caches, model.groups, 4)
    layout = HostSlotLayout.from_canonical(canonical)
    copier = BlockCopier(canonical, torch.empty(2, layout.slot_bytes, dtype=torch.int8))
    (segment,) = copier.segments[0]
    assert segment.refs == tuple(range(32)) and segment.block_bytes == 32 * 64 * 1024
    assert segment.engine.dtype == torch.int64


def _small_canonical(num_blocks: int):
    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=4, dtype=torch.float16,
                             page_size_padded=40)
    groups = [KVCacheGroup(["x", "y"], spec)]
    buffer, caches = allocate_kv_caches(groups, num_blocks, "LBNHC")
    randomize(buffer, 7)
    return canonicalize(caches, groups, num_blocks), buffer


@settings(max_examples=40, deadline=None)
@given(data=st.data(), strategy=st.sampled_from(STRATEGIES + [None]))
def test_any_pairs_any_strategy_match_reference(data, strategy):
    num_blocks = data.draw(st.integers(1, 24))
    num_slots = data.draw(st.integers(1, 24))
    n = data.draw(st.integers(0, min(num_blocks, num_slots)))
    # Runs appear often: draw a start and take consecutive ids mixed with random ones.
    slots = data.draw(st.permutations(range(num_slots)))[:n]
    blocks = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=n, max_size=n))
    canonical, buffer = _small_canonical(num_blocks)
    pool = torch.zeros(num_slots, HostSlotLayout.from_canonical(canonical).slot_bytes,
                       dtype=torch.int8)
    randomize(pool, 3)
    copier = BlockCopier(canonical, pool)
    expected_pool = reference_store(canonical, pool, {0: (blocks, slots)})
    copier.copy(copier.plan(Direction.STORE, {0: (blocks, slots)}), strategy)
    assert torch.equal(pool, expected_pool)
    # Load back: destinations must be distinct blocks.
    targets = data.draw(st.permutations(range(num_blocks)))[:n]
    randomize(buffer, 11)
    expected = reference_load(canonical, pool, {0: (targets, slots)}, buffer)
    copier.copy(copier.plan(Direction.LOAD, {0: (targets, slots)}), strategy)
    assert torch.equal(buffer, expected)


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.tuples(st.integers(1, 9), st.sampled_from([1, 3])), max_size=6),
       parts=st.integers(1, 4))
def test_shares_cover_every_row_once(counts, parts):
    views = {w: torch.zeros(1, w) for w in (1, 3)}
    ops = [Op("scatter", views[w], views[w], 100 * i, np.arange(k) + 1000 * i, k)
           for i, (k, w) in enumerate(counts)]
    shares = _shares(ops, parts)
    assert len(shares) <= parts
    rows = sorted((op.src + r, int(op.dst[r])) for share in shares for op in share
                  for r in range(op.count))
    assert rows == sorted((100 * i + r, 1000 * i + r) for i, (k, _) in enumerate(counts)
                          for r in range(k))
    weights = [sum(op.count * op.src_view.shape[1] for op in share) for share in shares]
    if weights:  # balanced to within one row of the heaviest kind
        assert max(weights) - min(weights) <= 2 * 3 or len(shares) < parts


@pytest.mark.parametrize("sort", ["compiled", "numpy"])
@settings(max_examples=120, deadline=None)
@given(data=st.data(), bits=st.sampled_from([1, 5, 11, 12, 22, 23, 32]))
def test_argsort_ids_is_a_stable_argsort_for_any_limit(sort, data, bits):
    # (limits of 1 to 3 radix digits of 11 bits; repeats test stability; a sorted list is
    # None; the numpy path takes both its counting and its comparison branch)
    limit = data.draw(st.integers(1, 2 ** bits))
    ids = data.draw(st.lists(st.integers(0, limit - 1), max_size=60)
                    | st.lists(st.sampled_from([0, limit - 1, limit // 2]), max_size=60))
    array = np.array(ids, dtype=np.int64)
    module = plan_kernels.HOST_ROWS
    if sort == "compiled" and module is None:
        pytest.skip("the compiled module is not built (see test_host_rows.py)")
    saved = plan_kernels.HOST_ROWS, plan_kernels.RADIX_MIN_IDS
    plan_kernels.HOST_ROWS = module if sort == "compiled" else None
    plan_kernels.RADIX_MIN_IDS = 0  # (lists this short reach the compiled sort too)
    try:
        order = argsort_ids(array, limit)
    finally:
        plan_kernels.HOST_ROWS, plan_kernels.RADIX_MIN_IDS = saved
    expected = np.argsort(array, kind="stable")
    if np.array_equal(expected, np.arange(array.size)):
        assert order is None
    else:
        assert order is not None and np.array_equal(order, expected)


@pytest.mark.parametrize("limit", [2 ** 11, 2 ** 22, 2 ** 32])
def test_the_compiled_sort_orders_large_arrays_over_every_digit(limit):
    # (one, two and three radix passes, over ids that differ in every digit, with repeats)
    if plan_kernels.HOST_ROWS is None:
        pytest.skip("the compiled module is not built (see test_host_rows.py)")
    rng = np.random.default_rng(limit)
    ids = rng.integers(0, limit, 50_000, dtype=np.int64)
    ids[::7] = ids[3]
    order = np.empty(ids.size, dtype=np.int64)
    assert plan_kernels.HOST_ROWS.order_ids(ids.ctypes.data, ids.size, limit,
                                            order.ctypes.data)
    assert np.array_equal(order, np.argsort(ids, kind="stable"))
    ids.sort()
    assert not plan_kernels.HOST_ROWS.order_ids(ids.ctypes.data, ids.size, limit,
                                                order.ctypes.data)


def test_the_compiled_sort_refuses_an_id_out_of_range_by_name():
    if plan_kernels.HOST_ROWS is None:
        pytest.skip("the compiled module is not built (see test_host_rows.py)")
    ids = np.array([3, 1, 7, 0], dtype=np.int64)
    order = np.full(4, -1, dtype=np.int64)
    with pytest.raises(ValueError, match=r"id 7 at position 2 is out of range; expected "
                                         r"0 <= id < 7"):
        plan_kernels.HOST_ROWS.order_ids(ids.ctypes.data, 4, 7, order.ctypes.data)
    assert (order == -1).all()  # (nothing written)
    with pytest.raises(ValueError, match="limit"):
        plan_kernels.HOST_ROWS.order_ids(ids.ctypes.data, 4, 2 ** 32 + 1, order.ctypes.data)


def test_copy_threads_leave_torch_threading_alone():
    import threading

    before = torch.get_num_threads()
    canonical, _ = _small_canonical(4)
    pool = torch.zeros(4, HostSlotLayout.from_canonical(canonical).slot_bytes, dtype=torch.int8)
    copier = BlockCopier(canonical, pool)
    copier.copy(copier.plan(Direction.STORE, {0: ([0, 1], [2, 3])}))
    seen = []
    probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    probe.start()
    probe.join()
    assert torch.get_num_threads() == before and seen == [before]
    pool_thread = copier._cpu._pool(Direction.STORE).submit(torch.get_num_threads).result()
    assert pool_thread == 1  # the copy threads themselves run kernels single-threaded
    copier.close()


def test_repeated_pairs_and_repeated_source_blocks():
    canonical, buffer = _small_canonical(6)
    pool = torch.zeros(8, HostSlotLayout.from_canonical(canonical).slot_bytes, dtype=torch.int8)
    blocks, slots = [4, 4, 2, 4, 2], [0, 5, 1, 0, 1]  # block 4 -> two slots; pairs repeated
    copier = BlockCopier(canonical, pool)
    expected = reference_store(canonical, pool, {0: (blocks, slots)})
    plan = copier.plan(Direction.STORE, {0: (blocks, slots)})
    assert plan.num_pairs == 3
    copier.copy(plan)
    assert torch.equal(pool, expected)
    assert copy_blocks(canonical, pool, 0, [1, 1], [5, 5], Direction.LOAD) > 0


@pytest.mark.parametrize("direction, blocks, slots, message", [
    (Direction.STORE, [6], [0], "block id 6 is out of range"),
    (Direction.STORE, [-1], [0], "block id -1 is out of range"),
    (Direction.LOAD, [0], [8], "slot id 8 is out of range"),
    (Direction.STORE, [0, 1], [0], "2 block ids but 1 slot ids"),
    (Direction.STORE, [0.5], [0], "ids must be a 1-D sequence of ints"),
    (Direction.STORE, [[0]], [0], "ids must be a 1-D sequence of ints"),
    (Direction.STORE, [0, 1], [3, 3], "slot 3 would receive two different sources"),
    (Direction.LOAD, [2, 2], [3, 4], "block 2 would receive two different sources"),
])
def test_bad_requests_raise_typed_errors(direction, blocks, slots, message):
    canonical, _ = _small_canonical(6)
    pool = torch.zeros(8, HostSlotLayout.from_canonical(canonical).slot_bytes, dtype=torch.int8)
    copier = BlockCopier(canonical, pool)
    with pytest.raises(TransferError, match=message):
        copier.plan(direction, {0: (blocks, slots)})


def test_unknown_group_and_cross_group_slot_clash():
    model = build_example("gemma3", 4)
    canonical = canonicalize(model.kv_caches, model.groups, 4)
    pool = torch.zeros(4, HostSlotLayout.from_canonical(canonical).slot_bytes, dtype=torch.int8)
    copier = BlockCopier(canonical, pool)
    with pytest.raises(TransferError, match="cache group 6 does not exist"):
        copier.plan(Direction.STORE, {6: ([0], [0])})
    with pytest.raises(TransferError, match="slot 1 is also written by another group"):
        copier.plan(Direction.STORE, {0: ([0], [1]), 2: ([3], [1])})


def test_pool_shape_is_checked():
    canonical, _ = _small_canonical(3)
    with pytest.raises(ValueError, match="host pool must be int8"):
        BlockCopier(canonical, torch.zeros(4, 10, dtype=torch.int8))
