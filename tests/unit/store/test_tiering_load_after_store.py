"""A load of keys whose store is still in flight waits for that store (the scheduler counts
the stores it planned as hits before the workers report them): it gets the stored bytes, or,
when the store does not put a key in host memory, fails that key (a recompute), never stale
or torn bytes. Real host tier, real copy threads."""

from __future__ import annotations

import torch

from kv_offload.types import Location

from unit.store.test_tiering import block_bytes, h, hybrid, make_store


def test_a_load_submitted_right_after_the_store_of_its_keys_gets_the_stored_bytes():
    buffer, canonical = hybrid()
    store = make_store(canonical, None, slots=8)
    expected = [block_bytes(canonical, 0, b) for b in (1, 2)]
    keys = [h(1), h(2)]
    # Both submitted before any poll: the store has not even reserved a host slot yet.
    stored = store.submit_store({0: (keys, [1, 2])})
    loaded = store.submit_load({0: (keys, [6, 7])})
    results = store.wait([stored, loaded])
    assert [r.success for r in results] == [True, True]
    assert results[1].failed == {}
    assert torch.equal(block_bytes(canonical, 0, 6), expected[0])
    assert torch.equal(block_bytes(canonical, 0, 7), expected[1])
    store.close()


def test_a_load_waiting_for_a_store_that_is_abandoned_fails_those_blocks_only():
    buffer, canonical = hybrid()
    store = make_store(canonical, None, slots=8)
    store.wait([store.submit_store({0: ([h(9)], [3])})])  # held before: served as usual
    held = block_bytes(canonical, 0, 3)
    stored = store.submit_store({0: ([h(1), h(2)], [1, 2])})
    loaded = store.submit_load({0: ([h(9), h(1), h(2)], [5, 6, 7])})
    before = [block_bytes(canonical, 0, b) for b in (6, 7)]
    store.abandon_store(stored)  # the engine went on: nothing it copied may be served
    results = store.wait([stored, loaded])
    assert not results[0].success
    assert results[1].failed == {0: [6, 7]}  # recomputed by the engine
    assert torch.equal(block_bytes(canonical, 0, 5), held)
    assert all(map(torch.equal, [block_bytes(canonical, 0, b) for b in (6, 7)], before))
    assert store.lookup([(h(1), 0), (h(2), 0)]) == [Location.ABSENT] * 2
    store.close()


def test_a_load_of_a_key_no_store_carries_fails_at_once():
    _, canonical = hybrid()
    store = make_store(canonical, None, slots=8)
    stored = store.submit_store({0: ([h(1)], [1])})
    loaded = store.submit_load({0: ([h(1), h(4)], [6, 7])})
    results = store.wait([stored, loaded])
    assert results[1].failed == {0: [7]}  # h(4) was never stored: no wait for it
    assert store.stores.storing == {}  # (every store ended: no key is awaited any more)
    store.close()
