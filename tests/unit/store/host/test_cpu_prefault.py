"""The host pool's pages are faulted in ahead of the slots in use (plain memory): a read
or copy into slots no one used yet pays no page faults. Real memory, a real thread; the
page faults are the calling thread's own counter (`getrusage`)."""

from __future__ import annotations

import resource
import sys

import pytest

from kv_offload import canonicalize
from kv_offload.store.host import HostTier
from kv_offload.store.manager import OffloadManager
from kv_offload.testing.example_models import build_example

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="MADV_POPULATE_WRITE is Linux's")
WAIT_S = 30


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt  # (this thread's only)


@pytest.fixture
def canonical():
    model = build_example("gemma3", 12)
    return canonicalize(model.kv_caches, model.groups, model.num_blocks)


def test_slots_no_one_used_yet_are_written_without_page_faults(canonical):
    with HostTier(canonical, 64 << 20, pin=False) as backend:  # 64 slots of 1 MiB
        assert backend.prefaulter is not None
        pages = 16 * backend.slot_bytes // 4096
        assert backend.prefaulter.wait_until(16 * backend.slot_bytes, WAIT_S)
        before = minor_faults()
        backend.pool[:16].numpy().fill(3)  # (this thread) as a read into 16 fresh slots
        assert minor_faults() - before < pages // 10  # (it was one fault per page)


def test_the_pages_ahead_follow_the_highest_slot_handed_out_and_keep_their_bytes(canonical):
    with HostTier(canonical, 64 << 20, pin=False) as backend:
        pool, slot = backend.pool, backend.slot_bytes
        pool[40:42].fill_(7)  # bytes already there (a copy racing the thread) stay
        backend.prefaulter._ahead = 4 * slot  # (a small window, to see it move)
        manager = OffloadManager(backend.num_slots)
        plan = manager.prepare_store([(bytes([i]), 0) for i in range(40)])
        assert sorted(plan.slots) == list(range(40)) and manager.high_water == 40
        backend.slots_in_use_below(manager.high_water)
        assert backend.prefaulter.wait_until(44 * slot, WAIT_S)
        assert bool((pool[40:42] == 7).all())
        before = minor_faults()
        pool[:44].numpy().fill(1)
        assert minor_faults() - before < 44 * slot // 4096 // 10


def test_freed_slots_are_reused_first_so_the_high_water_mark_only_counts_new_ones():
    manager = OffloadManager(8)
    first = manager.prepare_store([(b"a", 0), (b"b", 0), (b"c", 0)])
    manager.complete_store(list(first.keys), True)
    manager.prepare_load([(b"b", 0)])
    manager.complete_load([(b"b", 0)])
    assert manager.high_water == 3
    manager.reset()  # every slot freed
    manager.take_events()
    again = manager.prepare_store([(b"d", 0), (b"e", 0)])
    assert max(again.slots) < 3 and manager.high_water == 3  # no page past 3 was needed



def test_the_tiered_store_moves_the_window_as_its_manager_hands_out_slots(canonical,
                                                                          monkeypatch):
    from kv_offload.store.host import prefault
    from kv_offload.store.tiered import TieredStore

    monkeypatch.setattr(prefault, "AHEAD_BYTES", 2 << 20)  # two slots of 1 MiB
    store = TieredStore(canonical, 64 << 20, pin=False)
    try:
        prefaulter, slot = store.cpu.prefaulter, store.cpu.slot_bytes
        assert prefaulter.wait_until(2 * slot, WAIT_S)  # (what it started with)
        assert prefaulter.populated == 2 * slot
        store.manager.prepare_store([(bytes([i]), 0) for i in range(30)])  # e.g. a read
        store.poll()
        assert prefaulter.wait_until(32 * slot, WAIT_S)
    finally:
        store.close()


def test_with_most_of_the_window_left_the_refill_waits_until_demand_pauses(canonical,
                                                                           monkeypatch):
    # (the window moves when a hit stages into new slots: its reads must not share the cores
    # with the kernel zeroing pages; a quarter of the window is still ahead here)
    import time

    from kv_offload.store.host import prefault

    monkeypatch.setattr(prefault, "AHEAD_BYTES", 32 << 20)  # 32 slots of 1 MiB, of 64
    with HostTier(canonical, 64 << 20, pin=False) as backend:
        prefaulter, slot = backend.prefaulter, backend.slot_bytes
        prefaulter._settle_s = 2.0  # (generous: this thread must ask more often than that)
        assert prefaulter.wait_until(32 * slot, WAIT_S)  # the first window: at once
        for high_water in range(1, 9):  # demand keeps coming; 24+ slots stay ahead
            backend.slots_in_use_below(high_water)
            time.sleep(0.05)
        assert prefaulter.populated == 32 * slot
        assert prefaulter.wait_until(40 * slot, WAIT_S)  # then it fills, demand paused
        backend.slots_in_use_below(36)  # under a quarter left ahead: at once
        assert prefaulter.wait_until(64 * slot, 1.5)
