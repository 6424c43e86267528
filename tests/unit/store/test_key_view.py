"""KeyView: where this process's tiers hold each key, and the changes not yet reported,
checked against a plain model of the same semantics."""

from __future__ import annotations

import gc
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_offload.store.key_view import KeyView
from kv_offload.types import Location

HOST, STORAGE, ABSENT = Location.HOST, Location.STORAGE, Location.ABSENT
KEYS = [(bytes([i]) * 4, g) for i in range(5) for g in range(2)] + [(7, 0)]  # an int hash too
UPDATES = ("host_added", "host_removed", "storage_added", "storage_removed")

operations = st.lists(st.one_of(
    st.tuples(st.sampled_from(UPDATES), st.lists(st.sampled_from(KEYS), max_size=4)),
    st.tuples(st.just("take"), st.integers(0, len(KEYS) + 2)),
    st.tuples(st.just("reset"), st.none())), max_size=40)


@settings(max_examples=400, deadline=None)
@given(operations)
def test_take_reports_each_change_of_location_once_and_locations_are_current(ops):
    view = KeyView(report_storage_copies=True)  # (the model below tracks storage copies)
    host: set = set()
    storage: set = set()
    reported: dict = {}  # what the reader was told
    reset_pending = False

    def where(key):
        return HOST if key in host else STORAGE if key in storage else ABSENT

    def state(key):  # what a report says: the location, and a host key's storage copy
        return where(key), key in host and key in storage

    for op, arg in [*ops, ("take", len(KEYS))]:
        if op == "take":
            batch = view.take(arg)
            assert batch.reset is reset_pending
            reset_pending = False
            assert len(batch.changes) <= arg
            assert len({change.key for change in batch.changes}) == len(batch.changes)
            for change in batch.changes:
                told = (change.location, change.in_storage)
                assert told == state(change.key)
                assert reported.get(change.key, (ABSENT, False)) != told
                reported[change.key] = told
            if arg >= len(KEYS):  # room for everything: the reader is up to date
                assert all(reported.get(key, (ABSENT, False)) == state(key) for key in KEYS)
        elif op == "reset":
            view.reset()
            host.clear()
            storage.clear()
            reported.clear()
            reset_pending = True
        else:
            getattr(view, op)(arg)
            tier = host if op.startswith("host") else storage
            (tier.update if op.endswith("added") else tier.difference_update)(arg)
        for key in KEYS:
            assert view.location(key) is where(key)
            assert view.in_storage(key) is (key in storage)


def test_a_full_collection_skips_the_keys_held():
    # A million keys held in containers the collector tracks cost every full collection
    # ~50-150 ms (it walks them entry by entry); the view's per-group containers are
    # untracked (the few per-group entries above them are all it visits).
    view = KeyView()
    keys = [(os.urandom(32), g) for g in range(2) for _ in range(1000)]
    view.storage_added(keys)
    view.host_added(keys[:100])
    assert len(view.take(len(keys)).changes) == len(keys)
    gc.collect()
    more = [(os.urandom(32), 0) for _ in range(1000)]  # keys keep arriving (newly made,
    view.storage_added(more)                            # tracked tuples)
    view.host_added(more[:10])
    assert view.num_pending == len(more)
    for held in (view._host, view._storage, view._dirty, view._reported):  # per group
        assert held and not any(gc.is_tracked(hashes) for hashes in held.values())
    assert len(view.take(len(more)).changes) == len(more)


def test_without_events_a_host_keys_write_through_costs_no_report_entry():
    """(KV events off: the scheduler needs only where a key can be loaded from.)"""
    for report_copies, expected in ((True, [(Location.HOST, True)]), (False, [])):
        view = KeyView(report_storage_copies=report_copies)
        view.host_added([(b"k", 0)])
        assert [(c.location, c.in_storage) for c in view.take(10).changes] == \
            [(Location.HOST, False)]
        view.storage_added([(b"k", 0)])  # its write-through lands
        assert [(c.location, c.in_storage) for c in view.take(10).changes] == expected
        view.host_removed([(b"k", 0)])  # evicted from host memory: still on disk
        assert [c.location for c in view.take(10).changes] == [Location.STORAGE]
        view.host_added([(b"k", 0)])  # read back into host memory
        assert [(c.location, c.in_storage) for c in view.take(10).changes] == \
            [(Location.HOST, report_copies)]
