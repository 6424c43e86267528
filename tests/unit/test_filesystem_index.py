"""The filesystem tier's in-memory index: LRU by last access, byte budget, pins, scan merges."""

from __future__ import annotations

from kv_offload.backends.filesystem.index import KeyIndex, ScannedFile


def filled(budget: int, *keys: bytes, size: int = 10) -> KeyIndex:
    index = KeyIndex(budget)
    for key in keys:
        assert index.reserve(size) == []
        index.commit(key, size, size)
    return index


def test_eviction_takes_the_least_recently_accessed_key():
    index = filled(30, b"a", b"b", b"c")
    assert index.begin_read(b"a") == 10  # a read is an access
    index.end_read(b"a")
    assert index.touch(b"b")  # so is a rewrite of a stored key
    assert index.reserve(10) == [b"c"]
    assert index.contains([b"a", b"b", b"c"]) == [True, True, False]
    assert index.used_bytes == 30


def test_lookups_do_not_change_the_order():
    index = filled(20, b"a", b"b")
    index.contains([b"a"])
    assert index.reserve(10) == [b"a"]


def test_a_key_being_read_is_never_evicted():
    index = filled(30, b"a", b"b", b"c")
    index.begin_read(b"a")
    index.begin_read(b"a")
    assert index.reserve(20) == [b"b", b"c"]
    index.end_read(b"a")
    assert index.reserve(1) is None  # only `a` is left and it is still read once
    index.end_read(b"a")
    index.release(20)
    assert index.reserve(21) == [b"a"]


def test_a_file_that_cannot_fit_is_refused_without_evicting():
    index = filled(30, b"a", b"b")
    assert index.reserve(31) is None
    assert index.contains([b"a", b"b"]) == [True, True]
    assert index.used_bytes == 20


def test_reservations_count_until_committed_or_released():
    index = filled(30, b"a")
    assert index.reserve(10) == []
    assert index.reserve(10) == []
    assert index.used_bytes == 30
    assert index.reserve(10) == [b"a"]
    index.release(10)
    index.commit(b"x", 10, 12)
    assert index.used_bytes == 22


def test_scan_adopts_new_keys_by_mtime_and_drops_vanished_old_ones():
    index = filled(100, b"old", b"kept")
    generation = index.start_scan()
    index.commit(b"fresh", 0, 10)  # committed after the scan listed the directory
    added, dropped = index.merge_scan(
        [ScannedFile(b"kept", 15, 1.0), ScannedFile(b"n2", 10, 3.0), ScannedFile(b"n1", 10, 2.0)],
        generation,
    )
    assert (added, dropped) == (2, 1)
    present = index.contains([b"old", b"kept", b"fresh", b"n1", b"n2"])
    assert present == [False, True, True, True, True]
    assert index.used_bytes == 15 + 10 + 20
    index.budget_bytes = 30
    assert index.evict_to_budget() == [b"kept"]
    assert index.reserve(10) == [b"fresh"]  # then n1 (older mtime) before n2


def test_a_key_being_read_survives_a_scan_that_misses_it():
    index = filled(100, b"a")
    index.begin_read(b"a")
    index.merge_scan([], index.start_scan())
    assert index.contains([b"a"]) == [True]
    index.end_read(b"a")
    index.merge_scan([], index.start_scan())
    assert index.contains([b"a"]) == [False]
    assert index.used_bytes == 0
