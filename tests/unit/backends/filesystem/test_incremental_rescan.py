"""Rescans of the filesystem tier cost what changed, not what is stored (issue 25): a fan-out
directory whose mtime has not moved is not listed again, the root survey does not re-count
unchanged directories, and what other processes write or delete is still found.

What a rescan lists is observed through Python's audit events (``os.scandir`` raises one per
directory listed): real directories, real files, nothing replaced."""

from __future__ import annotations

import os
import sys
import time

from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig
from kv_offload.backends.filesystem.directory import FANOUT_DIRS
from kv_offload.backends.filesystem.fanout_scan import REVALIDATE_PER_SCAN
from kv_offload.backends.filesystem.fileformat import relative_path

from helpers.tier_helpers import chunk, write

FINGERPRINT = "model-a"
SIZE = 4096

_listed: list[str] | None = None  # directories os.scandir opened while recording


def _audit(event: str, args: tuple) -> None:
    if _listed is not None and event == "os.scandir":
        _listed.append(os.fspath(args[0]))


sys.addaudithook(_audit)  # (cannot be removed: it records only while _listed is a list)


def listed_during(fn) -> list[str]:
    global _listed
    _listed = []
    try:
        fn()
        return _listed
    finally:
        _listed = None


def make_tier(root, **options) -> FilesystemTier:
    return FilesystemTier(FilesystemTierConfig(str(root), FINGERPRINT, 1 << 30,
                                               rescan_interval_s=0, **options))


def age_tree(path: str, seconds: float = 60.0) -> None:
    """Set every directory's mtime back (as if nothing changed there for a minute)."""
    then = time.time() - seconds
    for dirpath, _, _ in os.walk(path):
        os.utime(dirpath, (then, then))


def fill_foreign(root, layout: str, n: int) -> None:
    """Files that are not ours: other names in our fan-out dirs, and a stale layout dir."""
    for i in range(n):
        fanout = FANOUT_DIRS[i % len(FANOUT_DIRS)]
        for base in (os.path.join(root, layout, fanout),
                     os.path.join(root, "kv-v1-0123abcd", fanout)):
            os.makedirs(base, exist_ok=True)
            with open(os.path.join(base, f"not-ours-{i}.dat"), "wb") as f:
                f.write(b"x" * 100)


def test_a_rescan_of_an_unchanged_directory_lists_only_a_few_fan_out_directories(tmp_path):
    tier = make_tier(tmp_path)
    keys = [chunk(i, SIZE)[0] for i in range(300)]
    assert write(tier, keys, [chunk(i, SIZE)[1] for i in range(300)]).ok
    layout = os.path.basename(os.path.dirname(os.path.dirname(tier.file_path(keys[0]))))
    fill_foreign(tmp_path, layout, 600)
    tier.rescan()  # (everything new is listed once)
    age_tree(str(tmp_path))
    tier.rescan()  # (the aged mtimes are trusted from now on)
    listed = listed_during(tier.rescan)
    # Before: all 256 fan-out directories of ours and 256 of the stale layout, every rescan.
    assert len(listed) <= 2 * REVALIDATE_PER_SCAN + 2, sorted(listed)
    assert tier.lookup(keys) == [True] * 300
    assert tier.stats().foreign_bytes == 600 * 100  # (the stale layout: counted, not walked)
    tier.close()


def test_files_another_process_writes_or_deletes_are_found_by_the_next_rescan(tmp_path):
    ours, theirs = make_tier(tmp_path), make_tier(tmp_path)
    mine = [chunk(i, SIZE)[0] for i in range(50)]
    assert write(ours, mine, [chunk(i, SIZE)[1] for i in range(50)]).ok
    age_tree(str(tmp_path))
    ours.rescan()
    theirs.rescan()
    assert theirs.lookup(mine) == [True] * 50
    new = [chunk(i, SIZE)[0] for i in range(50, 60)]
    assert write(theirs, new, [chunk(i, SIZE)[1] for i in range(50, 60)]).ok
    os.unlink(ours.file_path(mine[0]))  # (another process deletes one of ours)
    ours.rescan()
    assert ours.lookup(new) == [True] * 10
    assert ours.lookup(mine[:2]) == [False, True]
    ours.close()
    theirs.close()


def test_a_file_of_ours_deleted_before_any_listing_saw_it_is_dropped(tmp_path):
    tier = make_tier(tmp_path)
    key, data = chunk(7, SIZE)
    assert write(tier, [key], [data]).ok
    os.unlink(tier.file_path(key))  # (before the next rescan ever listed its directory)
    tier.rescan()
    assert tier.lookup([key]) == [False]
    tier.close()


def test_a_directory_changed_within_the_clock_tick_is_listed_again(tmp_path):
    tier = make_tier(tmp_path)
    other = make_tier(tmp_path)
    key, data = chunk(3, SIZE)
    fanout_dir = os.path.dirname(tier.file_path(key))
    tier.rescan()
    # Another process writes and puts the directory's mtime back where it was: a change the
    # mtime cannot show (same tick). The directory changed recently, so it is not trusted.
    before = os.stat(fanout_dir).st_mtime_ns
    assert write(other, [key], [data]).ok
    os.utime(fanout_dir, ns=(before, before))
    tier.rescan()
    assert tier.lookup([key]) == [True]
    assert os.path.exists(os.path.join(os.path.dirname(fanout_dir), relative_path(key)))
    tier.close()
    other.close()


def test_the_budget_survey_counts_a_file_added_to_an_unchanged_tree(tmp_path):
    tier = make_tier(tmp_path)
    fill_foreign(tmp_path, "kv-v1-ffff0000", 300)
    age_tree(str(tmp_path))
    tier.rescan()
    tier.rescan()
    assert tier.stats().foreign_bytes == 2 * 300 * 100
    with open(os.path.join(tmp_path, "kv-v1-0123abcd", "7f", "late.dat"), "wb") as f:
        f.write(b"y" * 1000)
    os.remove(os.path.join(tmp_path, "kv-v1-ffff0000", "00", "not-ours-0.dat"))
    tier.rescan()
    assert tier.stats().foreign_bytes == 2 * 300 * 100 + 1000 - 100
    tier.close()
