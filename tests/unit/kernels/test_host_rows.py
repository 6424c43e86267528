"""The compiled row loop (kernels/_host_rows.c) under the CPU copier: built by the install,
bit for bit what numpy's indexing does for any rows (aligned or not, streamed or not), chosen
by the cost rule for scattered pairs, and absent without harm (numpy and torch then)."""

from __future__ import annotations

import platform
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_offload.kernels import BlockCopier, Direction, HostSlotLayout
from kv_offload.kernels import cpu as cpu_kernels
from kv_offload.kernels.cpu import CpuCopier, Op, _loop_rows, choose, last_level_cache_bytes
from kv_offload.kernels.plan import GroupPlan

from unit.kernels.test_kernels import _small_canonical, randomize, reference_load, reference_store


def test_the_compiled_row_loop_is_built_by_this_install():
    # (pyproject.toml builds it as an optional extension: a failed build would otherwise
    # leave every test below running numpy's path without a word)
    assert cpu_kernels.HOST_ROWS is not None, (
        "kv_offload.kernels._host_rows was not built: install with a C compiler "
        "(pip install -e . prints the compiler's error)")
    if platform.machine() in ("x86_64", "AMD64"):
        assert cpu_kernels.HOST_ROWS.has_streaming()


@settings(max_examples=150, deadline=None)
@given(data=st.data(), streaming=st.booleans(), parts=st.integers(1, 3),
       part_bytes=st.sampled_from([0, 1, 15, 16, 17, 48, 100, 2048]),
       dst_shift=st.sampled_from([0, 1, 8, 16]), src_shift=st.sampled_from([0, 3, 16]),
       sides=st.sampled_from(["ids both sides", "src ids, dst a stretch",
                              "src a stretch, dst ids"]))
def test_the_loop_moves_any_rows_as_numpy_indexing_does(data, streaming, parts, part_bytes,
                                                        dst_shift, src_shift, sides):
    # Rows of `parts` parts with gaps between parts and rows (as a segment's strided
    # views), starting at any byte: aligned parts take the non-temporal stores when
    # streaming, the others memcpy.
    src_rows, dst_rows = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
    count = data.draw(st.integers(0, min(src_rows, dst_rows)))
    src_ids = np.array(data.draw(st.lists(st.integers(0, src_rows - 1), min_size=count,
                                          max_size=count)), dtype=np.int64)
    dst_ids = np.array(data.draw(st.permutations(range(dst_rows)))[:count], dtype=np.int64)
    src_side: int | np.ndarray = src_ids
    dst_side: int | np.ndarray = dst_ids
    if sides == "src ids, dst a stretch":
        start = data.draw(st.integers(0, dst_rows - count))
        dst_side, dst_ids = start, np.arange(start, start + count)
    elif sides == "src a stretch, dst ids":
        start = data.draw(st.integers(0, src_rows - count))
        src_side, src_ids = start, np.arange(start, start + count)
    pad = part_bytes + 32  # (a part's stride: the bytes after a part must stay untouched)
    src_buf = torch.empty(src_rows * parts * pad + 64, dtype=torch.int8)
    dst_buf = torch.empty(dst_rows * parts * pad + 64, dtype=torch.int8)
    randomize(src_buf, 1)
    randomize(dst_buf, 2)
    src = src_buf[src_shift:src_shift + src_rows * parts * pad].view(src_rows, parts, pad)
    dst = dst_buf[dst_shift:dst_shift + dst_rows * parts * pad].view(dst_rows, parts, pad)
    expected = dst_buf.numpy().copy()
    expected_view = expected[dst_shift:dst_shift + dst_rows * parts * pad].reshape(
        dst_rows, parts, pad)
    expected_view[dst_ids, :, :part_bytes] = src.numpy()[src_ids, :, :part_bytes]
    _loop_rows(Op("rows", src[:, :, :part_bytes], dst[:, :, :part_bytes], src_side, dst_side,
                  count, streaming))
    assert np.array_equal(dst_buf.numpy(), expected)  # (and nothing outside the rows)


@pytest.mark.parametrize("src_side, dst_side, bad", [
    (np.array([0, 1, 4]), np.array([2, 1, 0]), "source row 4 (of 4)"),  # past the end
    (np.array([0, 1, 2]), np.array([2, -1, 0]), "destination row -1 (of 3)"),  # negative
    (2, np.array([0, 1, 2]), "source row 4 (of 4)"),  # a stretch running off the end
    (np.array([3, 2, 1]), 1, "destination row 3 (of 3)"),
])
def test_an_index_out_of_its_array_is_an_error_never_a_write_outside_the_buffer(
        src_side, dst_side, bad):
    """Issue 45: the loop checks each row index against its side's rows (a planning bug is
    an IndexError naming the row); rows before the bad one are copied, nothing else is
    touched (the buffers extend past the views: guard bytes)."""
    src_buf = torch.arange(6 * 16, dtype=torch.int32).to(torch.int8)
    dst_buf = torch.full((5 * 16,), -1, dtype=torch.int8)
    src = src_buf[:4 * 16].view(4, 1, 16)  # 4 rows; 2 more rows of the buffer are not its
    dst = dst_buf[:3 * 16].view(3, 1, 16)  # 3 rows; 2 guard rows after it
    with pytest.raises(IndexError, match=rf"row \d of 3 copies .*{re.escape(bad)}"):
        _loop_rows(Op("rows", src, dst, src_side, dst_side, 3, False))
    assert (dst_buf[3 * 16:] == -1).all()  # the guard rows: untouched


def test_the_cost_rule_picks_the_loop_for_scattered_pairs_and_copy_for_runs():
    rng = np.random.default_rng(0)
    scattered = GroupPlan(0, rng.permutation(4096)[:1024], np.sort(rng.permutation(4096)[:1024]))
    assert choose(scattered, 2048, 4096, loop=True)[0] == "rows"
    assert choose(scattered, 2048, 4096, loop=False)[0] in ("gather", "scatter", "staged")
    one_run = GroupPlan(0, np.arange(100, 1124), np.arange(1024))
    assert choose(one_run, 2048, 4096, loop=True)[0] == "runs"
    with pytest.raises(ValueError, match="unknown copy strategy 'rows'"):
        choose(scattered, 2048, 4096, only="rows", loop=False)


@pytest.mark.parametrize("loop", [True, False], ids=["compiled loop", "numpy and torch"])
def test_a_copier_moves_scattered_pairs_with_or_without_the_loop(monkeypatch, loop):
    if not loop:
        monkeypatch.setattr(cpu_kernels, "HOST_ROWS", None)
    canonical, buffer = _small_canonical(64)
    pool = torch.zeros(40, HostSlotLayout.from_canonical(canonical).slot_bytes, dtype=torch.int8)
    randomize(pool, 5)
    copier = BlockCopier(canonical, pool)
    copier._cpu = CpuCopier(copier.segments, threads=2, split_bytes=0, stream_bytes=0)
    rng = np.random.default_rng(1)
    stores = {0: (rng.permutation(64)[:40], rng.permutation(40))}
    expected_pool = reference_store(canonical, pool, stores)
    copier.copy(copier.plan(Direction.STORE, stores))
    assert torch.equal(pool, expected_pool)
    loads = {0: (rng.permutation(64)[:40], rng.permutation(40))}
    randomize(buffer, 9)
    expected = reference_load(canonical, pool, loads, buffer)
    copier.copy(copier.plan(Direction.LOAD, loads))
    assert torch.equal(buffer, expected)
    assert ("rows" in copier.last_strategies(Direction.LOAD)) == loop
    copier.close()


def test_the_streaming_threshold_is_the_largest_cache():
    sizes = last_level_cache_bytes(default=7)
    assert sizes == 7 or sizes >= 1 << 16  # (a real machine's largest cache, or the default)
    assert last_level_cache_bytes() == cpu_kernels.STREAM_BYTES
    assert CpuCopier([[]]).stream_bytes == cpu_kernels.STREAM_BYTES
