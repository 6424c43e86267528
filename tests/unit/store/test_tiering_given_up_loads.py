"""A load its caller gave up on (an in-step load past the worker's bound, whose blocks vLLM
then recomputes): nothing of it reaches engine memory afterwards, and its result still comes
only once nothing of it is in flight. Real files, real threads; the storage tier's results
are held back (a slow disk) until the test lets them through."""

from __future__ import annotations

import threading

import torch

from kv_offload.types import Location

from unit.store.test_tiering import block_bytes, h, hybrid, make_store, wait_for_storage


def test_a_load_given_up_copies_nothing_into_the_engine_when_its_reads_land(
        tmp_path, monkeypatch):
    buffer, canonical = hybrid()
    keys = [h(i) for i in range(2)]
    writer = make_store(canonical, tmp_path, slots=8)
    writer.wait([writer.submit_store({0: (keys, [0, 1])})])
    writer.flush()
    writer.close()
    reader = make_store(canonical, tmp_path, slots=8)  # a new process: the keys are on disk
    wait_for_storage(reader, [(k, 0) for k in keys])
    flowing = threading.Event()  # set: the disk's results reach the store
    poll = reader.storage.poll
    monkeypatch.setattr(reader.storage, "poll", lambda: poll() if flowing.is_set() else [])
    targets = [4, 5]
    recomputed = [block_bytes(canonical, 0, b) for b in targets]  # (vLLM's bytes)
    job = reader.submit_load({0: (keys, targets)})
    assert reader.poll() == []  # planned: its reads are in flight
    reader.abandon_load(job)
    assert reader.poll() == []  # a result only once nothing of it is in flight
    flowing.set()
    (result,) = reader.wait([job])
    assert not result.success and result.failed == {0: targets}
    assert [torch.equal(block_bytes(canonical, 0, b), x)
            for b, x in zip(targets, recomputed)] == [True, True]
    # The bytes read stay in host memory: the next load of the keys hits there.
    assert reader.lookup([(k, 0) for k in keys]) == [Location.HOST] * 2
    (again,) = reader.wait([reader.submit_load({0: (keys, [6, 7])})])
    assert again.success and again.from_storage == 0
    reader.close()


def test_a_load_given_up_before_it_was_planned_fails_without_touching_anything(tmp_path):
    buffer, canonical = hybrid()
    keys = [h(i) for i in range(2)]
    store = make_store(canonical, None, slots=8)
    store.wait([store.submit_store({0: (keys, [0, 1])})])
    before = buffer.clone()
    job = store.submit_load({0: (keys, [4, 5])})
    store.abandon_load(job)
    (result,) = store.wait([job])
    assert not result.success and result.failed == {0: [4, 5]}
    assert torch.equal(buffer, before)
    store.close()
