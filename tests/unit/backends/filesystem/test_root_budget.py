"""The disk budget covers the whole root: layout directories of other fingerprints count,
stale ones are evicted oldest files first, live ones are never touched and share the budget.

Two tiers of different fingerprints share one real root. "Stale" is made the way it happens:
the tier is closed, and the surviving tier (with a short ``heartbeat_timeout_s``) watches its
directory stay unchanged for that long. Liveness never reads a file time against a clock:
directories whose heartbeat keeps changing stay live however far their time stamps are skewed
into the past, and dead ones go however far into the future (set with utime).
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import pytest
import torch

from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig
from kv_offload.backends.filesystem.fileformat import data_offset, layout_dir_name
from kv_offload.backends.filesystem.root_budget import HEARTBEAT_NAME, touch_heartbeat

from helpers.tier_helpers import chunk, read, write

SIZE = 8192
WINDOW = 0.4  # heartbeat_timeout_s of the tier that judges the others (fast tests)
FILE = data_offset(b"chunk-0", "new", SIZE) + SIZE  # the same for both fingerprints below


def make_tier(root, fingerprint: str, budget: int, **kw) -> FilesystemTier:
    kw.setdefault("rescan_interval_s", 0)
    return FilesystemTier(FilesystemTierConfig(str(root), fingerprint, budget, **kw))


def store(tier: FilesystemTier, *indices: int) -> None:
    for i in indices:  # one job each: every write can evict what landed before it
        assert write(tier, [chunk(i, SIZE)[0]], [chunk(i, SIZE)[1]]).ok


def reads_back(tier: FilesystemTier, i: int) -> bool:
    key, data = chunk(i, SIZE)
    out = torch.empty(SIZE, dtype=torch.uint8)
    return read(tier, [key], [out]).ok and torch.equal(out, data)


def files_of(root, fingerprint: str) -> list[str]:
    layout = os.path.join(str(root), layout_dir_name(fingerprint))
    return sorted(
        os.path.join(d, n) for d, _, names in os.walk(layout) for n in names
        if n.endswith(".safetensors")
    )


def age(root, fingerprint: str, seconds: float) -> None:
    """Make a layout directory look abandoned: heartbeat and files ``seconds`` old, its file of
    chunk i a second older than that of chunk i + 1 (so "oldest first" is well defined)."""
    layout = os.path.join(str(root), layout_dir_name(fingerprint))
    then = time.time() - seconds
    os.utime(os.path.join(layout, HEARTBEAT_NAME), (then, then))
    for path in files_of(root, fingerprint):
        i = int(bytes.fromhex(os.path.basename(path).split(".")[0]).decode().split("-")[1])
        os.utime(path, (then - 100 + i, then - 100 + i))


def watch_for(tier: FilesystemTier, seconds: float, beat=None) -> None:
    """Rescan ``tier`` every 50 ms for ``seconds`` (each rescan is an observation of the
    other directories); ``beat``, if given, runs before each (another engine's heartbeat)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if beat is not None:
            beat()
        tier.rescan()
        time.sleep(0.05)


def stored_chunks(root, fingerprint: str) -> list[int]:
    names = [os.path.basename(p).split(".")[0] for p in files_of(root, fingerprint)]
    return sorted(int(bytes.fromhex(n).decode().split("-")[1]) for n in names)


def test_a_stale_layout_directory_is_evicted_oldest_files_first_when_the_root_is_over_budget(
    tmp_path,
):
    old = make_tier(tmp_path, "old", 1 << 30)
    store(old, *range(6))
    old.close()
    age(tmp_path, "old", 3600)
    new = make_tier(tmp_path, "new", 8 * FILE, heartbeat_timeout_s=WINDOW)
    # (never watched yet: live, whatever its time stamps say)
    assert new.stats().live_foreign_dirs == 1
    # Its heartbeat stopped: one window; then its files are watched unchanged: another.
    watch_for(new, 2 * WINDOW + 0.2)
    assert new.stats().foreign_bytes >= 6 * FILE and new.stats().live_foreign_dirs == 0
    store(new, *range(100, 104))  # the stale bytes do not shrink the new tier's share
    assert stored_chunks(tmp_path, "old") == list(range(6))  # not over budget yet: kept
    new.rescan()  # 10 files under an 8-file budget: the two oldest stale files go
    assert stored_chunks(tmp_path, "old") == [2, 3, 4, 5]
    assert new.stats()["foreign_files_evicted"] == 2
    store(new, *range(104, 108))
    new.rescan()
    assert stored_chunks(tmp_path, "old") == []
    assert not os.path.exists(tmp_path / layout_dir_name("old"))  # empty dirs removed too
    assert new.stats()["foreign_dirs_removed"] == 1
    assert all(reads_back(new, i) for i in range(100, 108))
    assert new.stats().foreign_bytes == 0 and new.stats()["evictions"] == 0
    new.close()


def test_a_live_foreign_directory_is_never_deleted_and_the_live_tiers_split_the_budget(
    tmp_path,
):
    # (`first` beats every quarter of its timeout: live to `late` however long this takes)
    first = make_tier(tmp_path, "old", 8 * FILE, heartbeat_timeout_s=2 * WINDOW)
    store(first, *range(8))  # alone under the root: the whole budget is its share
    first.rescan()  # (its heartbeat says what it holds: others read that, not its files)
    late = make_tier(tmp_path, "new", 8 * FILE, heartbeat_timeout_s=2 * WINDOW)
    assert late.stats().live_foreign_dirs == 1
    assert late.stats().share_bytes == 4 * FILE  # its fair half, although `first` holds all
    store(late, *range(100, 106))  # room for four: it evicts its own least recent keys
    late.rescan()
    assert stored_chunks(tmp_path, "old") == list(range(8))  # never touched by `late`
    assert stored_chunks(tmp_path, "new") == [102, 103, 104, 105]
    assert late.stats()["evictions"] == 2 and late.stats()["foreign_files_evicted"] == 0
    first.rescan()  # the root is over budget: the first tier shrinks to its half
    assert first.stats().share_bytes == 4 * FILE
    assert stored_chunks(tmp_path, "old") == [4, 5, 6, 7]
    assert all(reads_back(first, i) for i in range(4, 8))

    first.close()  # the other engine stops; once watched unchanged, its directory is stale
    age(tmp_path, "old", 3600)
    watch_for(late, 4 * WINDOW + 0.2)
    assert late.stats().share_bytes == 8 * FILE
    store(late, 106, 107)
    late.rescan()  # 6 + 4 files under an 8-file budget: the two oldest stale files go
    assert stored_chunks(tmp_path, "old") == [6, 7]
    assert stored_chunks(tmp_path, "new") == list(range(102, 108))
    late.close()


def test_files_that_are_not_ours_count_against_the_budget_and_are_kept(tmp_path):
    os.makedirs(tmp_path / "notes")
    (tmp_path / "notes" / "readme.bin").write_bytes(b"\0" * (3 * FILE))
    tier = make_tier(tmp_path, "new", 8 * FILE)
    assert tier.stats().share_bytes == 5 * FILE
    store(tier, *range(7))
    tier.rescan()
    assert stored_chunks(tmp_path, "new") == [2, 3, 4, 5, 6]
    assert (tmp_path / "notes" / "readme.bin").stat().st_size == 3 * FILE
    tier.close()


def test_a_directory_of_an_older_format_counts_as_live_while_its_files_change(tmp_path):
    """Engines of older versions write no heartbeat: files that keep changing mean someone
    still uses it."""
    legacy = tmp_path / "kv-v0-0123456789abcdef" / "ab"
    legacy.mkdir(parents=True)
    for i in range(4):
        (legacy / f"{i:02x}.safetensors").write_bytes(b"\0" * FILE)
    tier = make_tier(tmp_path, "new", 6 * FILE, heartbeat_timeout_s=WINDOW)
    store(tier, *range(4))
    tier.rescan()
    assert len(os.listdir(legacy)) == 4 and tier.stats().live_foreign_dirs == 1
    assert stored_chunks(tmp_path, "new") == [1, 2, 3]  # its fair half of the budget
    then = time.time() - 3600
    for i, name in enumerate(sorted(os.listdir(legacy))):
        os.utime(legacy / name, (then + i, then + i))
    watch_for(tier, WINDOW + 0.2)  # now stale: its bytes no longer come off this tier's share
    assert tier.stats().share_bytes == 6 * FILE and tier.stats().live_foreign_dirs == 0
    store(tier, 4, 5)
    tier.rescan()  # 5 + 4 files under a 6-file budget: the three oldest legacy files go
    assert sorted(os.listdir(legacy)) == ["03.safetensors"]
    assert stored_chunks(tmp_path, "new") == [1, 2, 3, 4, 5]
    tier.close()


def test_a_tier_keeps_its_heartbeat_fresh_even_without_rescans(tmp_path):
    tier = make_tier(tmp_path, "new", 1 << 30, heartbeat_timeout_s=0.4)
    heartbeat = tmp_path / layout_dir_name("new") / HEARTBEAT_NAME
    os.utime(heartbeat, (1.0, 1.0))
    deadline = time.monotonic() + 10
    while heartbeat.stat().st_mtime < time.time() - 60:
        assert time.monotonic() < deadline, "the heartbeat was never touched"
        time.sleep(0.02)
    assert tier.stats()["rescans"] == 1  # (only the one at start)
    tier.close()


def test_a_layout_directory_deleted_under_a_running_tier_is_survived(tmp_path, caplog):
    """Someone removes the directory while the tier runs: its keys vanish from the index, the
    background rescans keep going (the failed heartbeat is logged once), and the next write
    brings the directory back."""
    tier = make_tier(tmp_path, "new", 1 << 30, rescan_interval_s=0.05)
    store(tier, 0, 1)
    caplog.set_level(logging.WARNING, logger="kv_offload.backends.filesystem")
    os.rename(tmp_path / layout_dir_name("new"), tmp_path / "trash")  # gone at once
    shutil.rmtree(tmp_path / "trash")
    deadline = time.monotonic() + 20
    while tier.lookup([chunk(0, SIZE)[0]]) != [False] or tier.stats()["root_survey_failed"] < 2:
        assert time.monotonic() < deadline, "rescans stopped"
        time.sleep(0.02)
    store(tier, 2)
    assert reads_back(tier, 2)
    rescans = tier.stats()["rescans"]
    while tier.stats()["rescans"] < rescans + 2:
        assert time.monotonic() < deadline, "rescans stopped"
        time.sleep(0.02)
    failures = [r.getMessage() for r in caplog.records if "root_survey" in r.getMessage()]
    assert len(failures) == 2, failures  # one when it starts failing, one when it recovers
    assert "root_surveys work again" in failures[1]
    assert tier.lookup([chunk(i, SIZE)[0] for i in range(3)]) == [False, False, True]
    tier.close()


def test_a_root_full_of_files_that_are_not_ours_refuses_writes_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kv_offload.backends.filesystem")
    (tmp_path / "big.bin").write_bytes(b"\0" * (4 * FILE))
    tier = make_tier(tmp_path, "new", 4 * FILE)
    assert tier.stats().share_bytes == 0
    assert write(tier, [chunk(0, SIZE)[0]], [chunk(0, SIZE)[1]]).succeeded == (False,)
    assert tier.stats()["write_failed_budget"] == 1
    os.unlink(tmp_path / "big.bin")
    tier.rescan()
    tier.rescan()
    store(tier, 0)
    logged = [r.getMessage() for r in caplog.records if "disk budget" in r.getMessage()
              or "has room again" in r.getMessage()]
    assert len(logged) == 2 and "nothing can be stored" in logged[0]
    tier.close()


def test_a_live_tier_is_sized_by_its_heartbeat_without_walking_its_files(tmp_path):
    layout = tmp_path / layout_dir_name("old")
    layout.mkdir()
    (layout / HEARTBEAT_NAME).write_bytes(b"kv-offload heartbeat: %d bytes\n" % (3 * FILE))
    (layout / "ab").mkdir()
    (layout / "ab" / "00.safetensors").write_bytes(b"\0" * FILE)  # what it says counts
    tier = make_tier(tmp_path, "new", 8 * FILE)
    stats = tier.stats()
    assert (stats.live_foreign_dirs, stats.foreign_bytes) == (1, 3 * FILE)
    assert stats.share_bytes == 5 * FILE
    (layout / HEARTBEAT_NAME).write_bytes(b"torn")  # no number: the directory is walked
    tier.rescan()
    assert tier.stats().foreign_bytes == FILE
    tier.close()


@pytest.mark.parametrize("skew_s", [-86400, 86400], ids=["a-day-behind", "a-day-ahead"])
def test_a_beating_directory_is_never_evicted_however_skewed_its_times_and_a_dead_one_is(
    tmp_path, skew_s,
):
    """Another engine on a host whose clock is a day behind (or ahead) on a shared
    filesystem where clients stamp the times: its heartbeat and files carry those stamps.
    While its heartbeat keeps changing its directory is never evicted, even with the root
    over budget; once it stops, the directory goes after it was watched unchanged."""
    old = make_tier(tmp_path, "old", 1 << 30)
    store(old, *range(6))
    old.close()
    layout = os.path.join(str(tmp_path), layout_dir_name("old"))

    def beat() -> None:  # (the other engine's heartbeat, stamped by its clock)
        touch_heartbeat(layout, 6 * FILE)
        then = time.time() + skew_s
        os.utime(os.path.join(layout, HEARTBEAT_NAME), (then, then))

    age(tmp_path, "old", -skew_s)
    new = make_tier(tmp_path, "new", 8 * FILE, heartbeat_timeout_s=WINDOW)
    store(new, *range(100, 104))  # with the other's 6 files, over budget: 10 of 8
    watch_for(new, 3 * WINDOW, beat)
    assert stored_chunks(tmp_path, "old") == list(range(6))
    assert new.stats().live_foreign_dirs == 1 and new.stats()["foreign_files_evicted"] == 0
    stopped = time.monotonic()
    deadline = stopped + 10
    while stored_chunks(tmp_path, "old") == list(range(6)):  # the engine is gone
        assert time.monotonic() < deadline, "a dead directory was kept"
        new.rescan()
        time.sleep(0.05)
    assert time.monotonic() - stopped >= WINDOW  # (not before it was watched unchanged)
    assert stored_chunks(tmp_path, "old") == [2, 3, 4, 5]  # the two oldest went
    new.close()
