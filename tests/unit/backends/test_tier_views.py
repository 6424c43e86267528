"""The Valkey tier's in-memory view: scans merged by generation, every change through the
change feed (the filesystem tier's ChangeFeed, tested with that tier)."""

from __future__ import annotations

from kv_offload.backends.common.server_keys import ServerKeys


def test_a_scan_drops_only_keys_that_predate_it():
    view = ServerKeys()
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
    view = ServerKeys()
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
