"""The filesystem tier's in-memory index: LRU by last access, byte budget, pins, scan merges,
evictions that wait for the write that caused them, and the change feed it keeps."""

from __future__ import annotations

import pytest

from kv_offload.backends.common import pacing
from kv_offload.backends.common.index import KeyIndex
from kv_offload.backends.common.listing import ScannedFile


def landed(index: KeyIndex, key: bytes, size: int = 10) -> list[bytes]:
    """Reserve room for ``key`` and commit it, as a successful write does; its evictions."""
    reservation = index.reserve(size)
    assert reservation is not None
    return index.commit(reservation, key, size)


def filled(budget: int, *keys: bytes, size: int = 10) -> KeyIndex:
    index = KeyIndex(budget)
    for key in keys:
        assert landed(index, key, size) == []
    return index


def test_eviction_takes_the_least_recently_accessed_key():
    index = filled(30, b"a", b"b", b"c")
    assert index.begin_read(b"a") == 10  # a read is an access
    index.end_read(b"a")
    assert index.touch(b"b")  # so is a rewrite of a stored key
    assert landed(index, b"d") == [b"c"]
    assert index.contains([b"a", b"b", b"c", b"d"]) == [True, True, False, True]
    assert index.used_bytes == 30


def test_lookups_do_not_change_the_order():
    index = filled(20, b"a", b"b")
    index.contains([b"a"])
    assert landed(index, b"c") == [b"a"]


def test_a_key_being_read_is_never_evicted():
    index = filled(30, b"a", b"b", b"c")
    index.begin_read(b"a")
    index.begin_read(b"a")
    assert index.reserve(20).victims == (b"b", b"c")
    index.end_read(b"a")
    assert index.reserve(1) is None  # b and c are taken already, a is still read once
    index.end_read(b"a")
    assert index.reserve(1).victims == (b"a",)


def test_a_file_that_cannot_fit_is_refused_without_evicting():
    index = filled(30, b"a", b"b")
    assert index.reserve(31) is None
    assert index.contains([b"a", b"b"]) == [True, True]
    assert index.used_bytes == 20


def test_reservations_count_until_committed_or_released():
    index = filled(30, b"a")
    first, second = index.reserve(10), index.reserve(10)
    assert first.victims == () and second.victims == ()
    assert index.used_bytes == 30
    third = index.reserve(10)
    assert third.victims == (b"a",)
    index.release(third)
    index.release(second)
    assert index.commit(first, b"x", 12) == []
    assert index.used_bytes == 22


def test_victims_stay_readable_until_the_write_lands_and_are_then_handed_back():
    index = filled(20, b"a", b"b")
    reservation = index.reserve(10)
    assert reservation.victims == (b"a",)
    assert index.contains([b"a"]) == [True]  # still on disk: lookups and reads find it
    assert index.used_bytes == 30  # its file is there until the new one lands
    assert index.reserve(10).victims == (b"b",)  # a doomed key is not chosen twice
    assert index.commit(reservation, b"c", 10) == [b"a"]
    assert index.contains([b"a", b"b", b"c"]) == [False, True, True]


def test_a_failed_write_keeps_its_victims_in_the_index():
    index = filled(20, b"a", b"b")
    reservation = index.reserve(10)
    assert reservation.victims == (b"a",)
    index.release(reservation)
    assert index.contains([b"a", b"b"]) == [True, True]
    assert index.used_bytes == 20
    assert index.reserve(10).victims == (b"a",)  # and it is the first victim again


def test_a_victim_read_before_the_write_lands_is_rescued():
    index = filled(20, b"a", b"b")
    reservation = index.reserve(10)
    assert index.begin_read(b"a") == 10  # the access makes `a` recent: not worth evicting
    index.end_read(b"a")
    assert index.commit(reservation, b"c", 10) == []
    assert index.contains([b"a", b"b", b"c"]) == [True, True, True]
    assert index.evict_to_budget() == [b"b"]  # the overshoot goes at the next eviction


def test_scan_adopts_new_keys_by_mtime_and_drops_vanished_old_ones():
    index = filled(100, b"old", b"kept")
    generation = index.start_scan()
    assert landed(index, b"fresh") == []  # committed after the scan listed the directory
    merged = index.merge_scan(
        [ScannedFile(b"kept", 15, 1.0), ScannedFile(b"n2", 10, 3.0), ScannedFile(b"n1", 10, 2.0)],
        generation,
    )
    assert (merged.added, merged.dropped, merged.resized) == (2, 1, 1)
    present = index.contains([b"old", b"kept", b"fresh", b"n1", b"n2"])
    assert present == [False, True, True, True, True]
    assert index.used_bytes == 15 + 10 + 20
    index.set_budget(30)
    assert index.evict_to_budget() == [b"kept"]
    assert landed(index, b"x") == [b"fresh"]  # then n1 (older mtime) before n2
    assert landed(index, b"y") == [b"n1"]


def test_a_key_being_read_survives_a_scan_that_misses_it():
    index = filled(100, b"a")
    index.begin_read(b"a")
    index.merge_scan([], index.start_scan())
    assert index.contains([b"a"]) == [True]
    index.end_read(b"a")
    index.merge_scan([], index.start_scan())
    assert index.contains([b"a"]) == [False]
    assert index.used_bytes == 0


def test_a_key_removed_while_a_scan_runs_is_not_adopted_from_its_listing():
    index = filled(100, b"a")
    generation = index.start_scan()
    listing = [ScannedFile(b"a", 10, 1.0)]  # listed before this process deleted the file
    assert index.remove(b"a")
    assert index.merge_scan(listing, generation).added == 0
    assert index.contains([b"a"]) == [False]


def test_merges_of_many_keys_agree_with_a_plain_model():
    """Thousands of keys across every bucket: adopt, keep, resize and drop as a dict would."""
    index = KeyIndex(1 << 40)
    old = [ScannedFile(f"k{i}".encode(), 100 + i % 7, float(i)) for i in range(20_000)]
    assert index.merge_scan(old, index.start_scan(), pause=None).added == 20_000
    pauses = []
    later = [ScannedFile(f.key, f.size + (f.mtime % 5 == 0), f.mtime) for f in old[5_000:]]
    later += [ScannedFile(f"n{i}".encode(), 50, 1e6 + i) for i in range(7_000)]
    merged = index.merge_scan(later, index.start_scan(), pause=lambda: pauses.append(1))
    assert (merged.added, merged.dropped, merged.resized) == (7_000, 5_000, 3_000)
    assert len(pauses) >= 3  # the work was split into steps
    assert sorted(index.keys()) == sorted(f.key for f in later)
    assert index.used_bytes == sum(f.size for f in later)
    index.set_budget(50 * 7_000)  # room for the adopted keys only: they are the most recent
    assert set(index.evict_to_budget(pause=None)) == {f.key for f in later[:15_000]}


@pytest.mark.parametrize("at_pause", range(0, 45, 2))
def test_changes_made_while_a_merge_pauses_are_not_undone_by_it(monkeypatch, at_pause):
    """Commits, removals and reads that happen in any pause of a merge (the moments another
    thread can take the lock) survive it; the feed, replayed, agrees with the index."""
    monkeypatch.setattr(pacing, "STEP_S", 0.0)  # pause at every chance the merge offers
    others = [b"n%d" % i for i in range(400)]
    index = filled(1 << 30, b"kept", b"vanished", b"pinned", b"removed-meanwhile", *others)
    listing = [ScannedFile(k, 10, 1.0) for k in (b"kept", b"removed-meanwhile", *others)]
    listing += [ScannedFile(b"new%d" % i, 10, 2.0 + i) for i in range(30)]
    listing += [ScannedFile(b"committed-meanwhile", 10, 1.5)]
    generation = index.start_scan()
    pauses, pinned = [], []

    def pause() -> None:
        if len(pauses) == at_pause:
            assert index.remove(b"removed-meanwhile")
            assert landed(index, b"committed-meanwhile") == []
            assert landed(index, b"written-meanwhile") == []
            # Not listed: pinned in time if the merge has not reached its shard yet.
            pinned.append(index.begin_read(b"pinned") == 10)
        pauses.append(1)

    index.feed.take(1000)
    index.merge_scan(listing, generation, pause=pause)
    assert len(pauses) > at_pause, "the merge paused less often than this case needs"
    held = set(index.keys())
    assert {b"kept", b"committed-meanwhile", b"written-meanwhile"} <= held
    assert (b"pinned" in held) == pinned[0]
    assert {b"new%d" % i for i in range(30)} | set(others) <= held
    assert not {b"vanished", b"removed-meanwhile"} & held
    assert index.used_bytes == 10 * len(held)
    changes = index.feed.take(1000)
    assert b"vanished" in changes.removed and b"removed-meanwhile" in changes.removed
    assert set(changes.added) <= held and not set(changes.removed) & held


def test_a_key_that_served_a_hit_outlives_newer_keys_stored_once():
    """Segmented LRU: writes enter probation, a touch (a lookup's hit) protects; the
    victims are probation's least recent keys, however recent the protected ones are not."""
    index = filled(40, b"hit", b"a", b"b")
    index.touch_each([b"hit", b"absent"])  # (keys not stored are ignored)
    assert landed(index, b"c") == []
    assert landed(index, b"d") == [b"a"]
    assert landed(index, b"e") == [b"b"]
    assert index.contains([b"hit", b"c", b"d", b"e"]) == [True] * 4
    assert set(landed(index, b"f", size=30)) == {b"c", b"d", b"e"}
    assert index.contains([b"hit"]) == [True]
