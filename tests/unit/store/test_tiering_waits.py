"""What a load waits for costs the store's poll nothing until it can have changed: a key a
store is still putting in a host slot is looked at again only once a store settled, and a
storage read is given up at its deadline however many writes are in flight beside it. Real
host tier, real filesystem tier on real files, real copy threads; a copy is held by the test
(`Stall`), and the disk's answers are held back, as a slow disk's would be."""

from __future__ import annotations

import threading
import time

import torch

from unit.store.host.test_cpu_backend_stalled_copies import Stall
from unit.store.test_tiering import block_bytes, h, hybrid, make_store, wait_for_storage

WAIT_S = 20.0


def poll_until_done(store, job_ids: list[int]) -> dict:
    """Poll until these jobs ended (their results by id), at most WAIT_S."""
    results, deadline = {}, time.monotonic() + WAIT_S
    while set(job_ids) - results.keys():
        assert time.monotonic() < deadline, f"jobs never ended: {set(job_ids) - results.keys()}"
        results.update((r.job_id, r) for r in store.poll())
        time.sleep(0.002)
    return results


def reader_of(canonical, tmp_path, keys: list[bytes], **kw):
    """A new store over a disk another one wrote `keys` to (from engine blocks 1, 2, ...),
    once its storage tier shows them."""
    writer = make_store(canonical, tmp_path, slots=8)
    writer.wait([writer.submit_store({0: (keys, list(range(1, 1 + len(keys))))})])
    writer.flush()
    writer.close()
    reader = make_store(canonical, tmp_path, slots=8, **kw)
    wait_for_storage(reader, [(k, 0) for k in keys])
    return reader


def test_a_load_awaiting_a_stores_key_is_checked_again_only_once_a_store_settled(monkeypatch):
    _, canonical = hybrid()
    store = make_store(canonical, None, slots=8)
    stall = Stall(monkeypatch)  # the store's copy into its host slot: held at its start
    key = h(1)
    storing = store.submit_store({0: ([key], [1])})
    loading = store.submit_load({0: ([key], [5])})  # (the key is on its way: awaited)
    store.poll()  # the load is planned: its key awaited, looked at once
    assert stall.held.wait(WAIT_S)  # the store's copy started, and is held
    looked_up: list[list] = []
    lookup = store.manager.lookup
    monkeypatch.setattr(store.manager, "lookup",
                        lambda keys: (looked_up.append(list(keys)), lookup(keys))[1])

    def times_awaited_key_looked_at() -> int:
        return sum((key, 0) in keys for keys in looked_up)

    for _ in range(50):  # polls while nothing settles
        assert not store.poll()
    assert times_awaited_key_looked_at() == 0
    # Once the store lands, the very next polls copy it (not the deadline's, 30 s away).
    stall.release()
    results = poll_until_done(store, [storing, loading])
    assert results[storing].success and results[loading].success
    assert torch.equal(block_bytes(canonical, 0, 5), block_bytes(canonical, 0, 1))
    store.close()


def test_a_load_awaiting_a_key_its_store_skipped_fails_it_at_once(monkeypatch):
    """The store ends without putting the key in a slot (no room: the only slot is pinned
    by a load whose copy is held), and no store completes meanwhile: the load still learns
    of it at its next poll and fails the key (a recompute), not at its deadline."""
    _, canonical = hybrid()
    store = make_store(canonical, None, slots=1)
    assert store.wait([store.submit_store({0: ([h(1)], [1])})])[0].success
    stall = Stall(monkeypatch)
    pinning = store.submit_load({0: ([h(1)], [4])})  # pins the only slot while it copies
    store.poll()
    assert stall.held.wait(WAIT_S)
    skipped = store.submit_store({0: ([h(2)], [2])})  # no room: skipped at its staging
    loading = store.submit_load({0: ([h(2)], [5])})  # (its key on its way: awaited)
    started = time.monotonic()
    results = poll_until_done(store, [skipped, loading])
    assert time.monotonic() - started < store.read_timeout_s
    assert results[skipped].skipped == 1
    assert not results[loading].success and results[loading].failed == {0: [5]}
    stall.release()
    assert poll_until_done(store, [pinning])[pinning].success
    store.close()


def test_loads_sharing_one_read_copy_its_keys_as_it_lands_not_at_their_deadline(tmp_path):
    """The second and third loads await the first one's read (no store of theirs ends):
    the read completing is what makes them look again."""
    _, canonical = hybrid()
    keys = [h(30), h(31)]
    reader = reader_of(canonical, tmp_path, keys)  # (reads' deadline: 30 s, > WAIT_S)
    jobs = [reader.submit_load({0: (keys, [4 + 2 * i, 5 + 2 * i])}) for i in range(3)]
    results = poll_until_done(reader, jobs)
    assert all(results[j].success for j in jobs)
    assert all(torch.equal(block_bytes(canonical, 0, 4 + 2 * i), block_bytes(canonical, 0, 1))
               for i in range(3))
    reader.close()


def test_a_read_past_its_deadline_is_given_up_while_writes_are_in_flight(tmp_path,
                                                                         monkeypatch):
    _, canonical = hybrid()
    keys = [h(10), h(11)]
    reader = reader_of(canonical, tmp_path, keys, read_timeout_s=0.3)
    flowing = threading.Event()  # set: the disk's answers reach the store
    poll = reader.storage.poll
    monkeypatch.setattr(reader.storage, "poll", lambda: poll() if flowing.is_set() else [])
    # Writes through to disk queued first (their answers held back too), then the load.
    for i in range(4):
        reader.submit_store({0: ([h(20 + i)], [3 + i])})
    deadline = time.monotonic() + WAIT_S
    while len(reader.book.storage_jobs) < 4:  # (their copies landed: the writes are out)
        assert time.monotonic() < deadline, "the write-throughs never started"
        reader.poll()
        time.sleep(0.002)
    started = time.monotonic()
    loading = reader.submit_load({0: (keys, [7, 8])})
    result = poll_until_done(reader, [loading])[loading]
    assert time.monotonic() - started >= 0.3
    assert not result.success and result.failed == {0: [7, 8]}  # recomputed, never waited on
    flowing.set()  # the late answers land: nothing breaks, and the keys serve again
    assert reader.flush(WAIT_S)  # (every write-through ended too)
    again = reader.submit_load({0: (keys, [9, 10])})
    assert poll_until_done(reader, [again])[again].success
    assert torch.equal(block_bytes(canonical, 0, 9), block_bytes(canonical, 0, 1))
    reader.close()
