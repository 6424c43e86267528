"""Stores larger than the host tier are staged through it into the storage tier (real files,
real copy threads): every block arrives on disk, bit-exact, and the host tier never holds
more than its slots."""

from __future__ import annotations

import torch

from kv_offload.types import Location

from unit.store.test_tiering import NUM_BLOCKS, block_bytes, h, hybrid, make_store, wait_for_storage

BLOCKS = list(range(1, NUM_BLOCKS))  # 11 engine blocks


def test_a_store_eleven_times_the_host_tier_reaches_the_disk_whole_and_loads_back_exactly(
        tmp_path):
    buffer, canonical = hybrid()
    expected = {b: block_bytes(canonical, 0, b) for b in BLOCKS}
    keys = [(h(b), 0) for b in BLOCKS]
    store = make_store(canonical, tmp_path, slots=1)
    [stored] = store.wait([store.submit_store({0: ([h(b) for b in BLOCKS], BLOCKS)})])
    assert stored.success and stored.skipped == 0 and stored.failed == {}
    wait_for_storage(store, keys[:-1])  # the last one may still be on the host
    assert store.lookup(keys).count(Location.HOST) <= 1
    buffer.zero_()
    [loaded] = store.wait([store.submit_load({0: ([h(b) for b in BLOCKS], BLOCKS)})])
    assert loaded.success
    for b in BLOCKS:
        assert torch.equal(block_bytes(canonical, 0, b), expected[b]), f"block {b}"
    store.close()


def test_without_a_storage_tier_a_store_keeps_what_fits_and_skips_the_rest_at_once():
    _, canonical = hybrid()
    store = make_store(canonical, None, slots=3)
    [stored] = store.wait([store.submit_store({0: ([h(b) for b in BLOCKS], BLOCKS)})],
                          timeout=5.0)
    assert not stored.success and stored.skipped == len(BLOCKS) - 3
    assert stored.failed == {0: BLOCKS[3:]}
    assert store.lookup([(h(b), 0) for b in BLOCKS[:3]]) == [Location.HOST] * 3
    store.close()


def test_a_store_that_cannot_get_room_before_its_deadline_skips_the_rest(tmp_path):
    _, canonical = hybrid()
    store = make_store(canonical, tmp_path, slots=2, store_stage_timeout_s=0.0)
    [stored] = store.wait([store.submit_store({0: ([h(b) for b in BLOCKS], BLOCKS)})])
    assert not stored.success and 0 < stored.skipped < len(BLOCKS)
    assert sum(len(ids) for ids in stored.failed.values()) == stored.skipped
    store.close()


def test_an_abandoned_staged_store_copies_nothing_more_and_serves_nothing_it_copied(tmp_path):
    _, canonical = hybrid()
    store = make_store(canonical, tmp_path, slots=1)
    job = store.submit_store({0: ([h(b) for b in BLOCKS], BLOCKS)})
    store.abandon_store(job)
    [stored] = store.wait([job])
    assert not stored.success
    assert store.flush()
    store.poll()
    assert store.lookup([(h(b), 0) for b in BLOCKS]) == [Location.ABSENT] * len(BLOCKS)
    store.close()
