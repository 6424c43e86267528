"""The in-memory views of shared tiers: ChangeFeed (bounded chunks of what a view gained and
lost, latest state winning) and the Valkey tier's KeyView (scans merged by generation)."""

from __future__ import annotations

import pytest

from kv_offload.backends.changes import ChangeFeed
from kv_offload.backends.valkey.view import KeyView


def test_nothing_is_recorded_before_the_first_take_which_starts_from_a_snapshot():
    feed = ChangeFeed()
    feed.added([b"a", b"b"])
    feed.removed([b"a"])
    assert len(feed) == 0  # nobody subscribed: no backlog grows
    first = feed.take(2, lambda: [b"b", b"c", b"d"])
    assert first.added == (b"b", b"c") and first.removed == ()
    assert feed.take(10, lambda: pytest.fail("snapshot taken twice")).added == (b"d",)


def test_the_latest_state_of_a_key_wins_and_moves_it_to_the_end():
    feed = ChangeFeed()
    feed.take(1, list)
    feed.added([b"a", b"b", b"c"])
    feed.removed([b"a"])
    feed.added([b"b"])
    changes = feed.take(10, list)
    assert changes.added == (b"c", b"b") and changes.removed == (b"a",)
    assert feed.take(10, list).added == () and len(feed) == 0


def test_chunks_are_bounded_and_keep_the_order():
    feed = ChangeFeed()
    feed.take(1, list)
    feed.added([bytes([i]) for i in range(10)])
    chunks = [feed.take(3, list) for _ in range(4)]
    assert [len(c) for c in chunks] == [3, 3, 3, 1]
    assert b"".join(k for c in chunks for k in c.added) == bytes(range(10))
    with pytest.raises(ValueError, match="max_keys must be >= 1"):
        feed.take(0, list)


def test_a_scan_drops_only_keys_that_predate_it():
    view = KeyView()
    view.add([b"old", b"kept"])
    generation = view.begin_scan()
    view.add([b"written-during-the-scan"])  # SCAN may or may not have seen it
    added, dropped = view.merge_scan([b"kept", b"found"], generation)
    assert (added, dropped) == (1, 1)
    assert view.contains([b"old", b"kept", b"written-during-the-scan", b"found"]) == \
        [False, True, True, True]
    # The next scan that misses it drops it: it was confirmed before that scan began.
    assert view.merge_scan([b"kept", b"found"], view.begin_scan()) == (0, 1)


def test_the_view_reports_every_change_through_its_feed():
    view = KeyView()
    view.add([b"a"])
    assert view.take_changes(10).added == (b"a",)  # the first take lists what is there
    view.add([b"b"])
    view.discard([b"a", b"never-held"])
    changes = view.take_changes(10)
    assert changes.added == (b"b",) and changes.removed == (b"a",)
    view.merge_scan([b"c"], view.begin_scan())
    changes = view.take_changes(10)
    assert changes.added == (b"c",) and changes.removed == (b"b",)
    view.clear()
    assert view.take_changes(10).removed == (b"c",) and len(view) == 0
