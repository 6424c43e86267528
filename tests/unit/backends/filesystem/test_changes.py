"""The filesystem tier's change feed (`take_changes`): the start-up inventory in chunks, own
writes, evictions, bad files, and other processes' writes and deletes found by rescans."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_offload.backends.base import TierChanges
from kv_offload.backends.common.changes import ChangeFeed
from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig
from kv_offload.backends.filesystem.fileformat import data_offset
from kv_offload.errors import TierRequestError

from helpers.tier_helpers import child_command, chunk, read, wait, write

FINGERPRINT = "model-a"
SIZE = 4096
FILE = data_offset(b"chunk-0", FINGERPRINT, SIZE) + SIZE


def make_tier(root, budget: int = 1 << 30) -> FilesystemTier:
    return FilesystemTier(FilesystemTierConfig(str(root), FINGERPRINT, budget, rescan_interval_s=0))


def store(tier: FilesystemTier, *indices: int) -> list[bytes]:
    """Write the chunks one job after another (so they land, and age, in this order)."""
    for i in indices:
        assert write(tier, [chunk(i, SIZE)[0]], [chunk(i, SIZE)[1]]).ok
    return [chunk(i, SIZE)[0] for i in indices]


def drain(tier: FilesystemTier, max_keys: int = 1000) -> TierChanges:
    """Every pending change, in one record (asserting no key shows up twice)."""
    added, removed = [], []
    while changes := tier.take_changes(max_keys):
        added += changes.added
        removed += changes.removed
    assert len(set(added + removed)) == len(added) + len(removed)
    return TierChanges(tuple(added), tuple(removed))


def test_a_restarted_tier_hands_out_its_inventory_in_bounded_chunks(tmp_path):
    first = make_tier(tmp_path)
    keys = store(first, *range(25))
    first.close()
    again = make_tier(tmp_path)
    chunks = [again.take_changes(10) for _ in range(4)]
    assert [len(c) for c in chunks] == [10, 10, 5, 0]
    assert all(c.removed == () for c in chunks)
    assert sorted(k for c in chunks for k in c.added) == sorted(keys)
    again.close()


def test_own_writes_are_added_once_even_when_rewritten(tmp_path):
    tier = make_tier(tmp_path)
    assert drain(tier) == TierChanges()
    keys = store(tier, 0, 1)
    store(tier, 1)  # already stored: no new change
    assert sorted(drain(tier).added) == sorted(keys)
    assert drain(tier) == TierChanges()
    tier.close()


def test_evictions_show_up_as_removed(tmp_path):
    tier = make_tier(tmp_path, budget=3 * FILE)
    old = store(tier, 0, 1, 2)
    drain(tier)
    new = store(tier, 3, 4)
    changes = drain(tier)
    assert sorted(changes.added) == sorted(new)
    assert sorted(changes.removed) == sorted(old[:2])
    tier.close()


def test_a_key_added_and_evicted_before_a_take_is_reported_once_as_removed(tmp_path):
    tier = make_tier(tmp_path, budget=2 * FILE)
    keys = store(tier, 0, 1, 2, 3)
    changes = drain(tier)
    assert sorted(changes.added) == sorted(keys[2:])
    assert sorted(changes.removed) == sorted(keys[:2])
    tier.close()


def test_a_bad_file_found_by_a_read_shows_up_as_removed(tmp_path):
    tier = make_tier(tmp_path)
    (key,) = store(tier, 0)
    drain(tier)
    with open(tier.file_path(key), "r+b") as f:
        f.seek(FILE - 1)
        f.write(b"\xff" if f.read(1) != b"\xff" else b"\0")
    assert not read(tier, [key], [torch.empty(SIZE, dtype=torch.uint8)]).ok
    assert drain(tier) == TierChanges(removed=(key,))
    tier.close()


def test_another_process_writes_show_up_as_added_and_its_deletes_as_removed(tmp_path):
    tier = make_tier(tmp_path)
    drain(tier)
    done = subprocess.run(child_command("write", tmp_path, FINGERPRINT, 100, 6, SIZE, 0),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    theirs = [chunk(i, SIZE)[0] for i in range(100, 106)]
    assert drain(tier) == TierChanges()  # nothing known before a rescan
    tier.rescan()
    assert sorted(drain(tier).added) == sorted(theirs)
    gone = [tier.file_path(k) for k in theirs[:3]]
    deleter = "import os, sys\nfor path in sys.argv[1:]:\n    os.unlink(path)"
    subprocess.run([sys.executable, "-c", deleter, *gone], check=True, timeout=60)
    tier.rescan()
    changes = drain(tier)
    assert changes.added == () and sorted(changes.removed) == sorted(theirs[:3])
    assert tier.lookup(theirs) == [False] * 3 + [True] * 3
    tier.close()


def test_max_keys_must_be_a_positive_int(tmp_path):
    tier = make_tier(tmp_path)
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(TierRequestError, match="max_keys"):
            tier.take_changes(bad)
    tier.close()


def test_writes_and_takes_racing_in_threads_lose_no_change(tmp_path):
    """Replaying every change taken while four threads submit writes (200 keys through 8 I/O
    threads, evicting down to 40) gives exactly the keys the tier holds at the end."""
    tier = make_tier(tmp_path, budget=40 * FILE)
    known: set[bytes] = set()
    stop = threading.Event()
    job_ids: list[int] = []

    def take_forever() -> None:
        while not stop.is_set():
            changes = tier.take_changes(7)
            assert not set(changes.added) & set(changes.removed)
            known.update(changes.added)
            known.difference_update(changes.removed)

    def submit_some(first: int) -> None:
        for i in range(first, 200, 4):
            key, data = chunk(i, SIZE)
            job_ids.append(tier.submit_write([key], [data]))

    taker = threading.Thread(target=take_forever)
    taker.start()
    writers = [threading.Thread(target=submit_some, args=(w,)) for w in range(4)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    results = wait(tier, job_ids)
    stop.set()
    taker.join()
    # (Writes that find the budget taken by writes still in flight fail: counted, not stored.)
    assert sum(r.ok for r in results.values()) == tier.stats()["write_ok"] >= 40
    changes = drain(tier)
    known.update(changes.added)
    known.difference_update(changes.removed)
    assert known == set(tier.keys())
    assert len(known) == 40
    tier.close()


OPS = st.lists(st.tuples(st.sampled_from(["add", "remove", "take"]), st.integers(0, 9)),
               max_size=60)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_a_feed_replayed_by_its_reader_agrees_with_the_latest_state_of_every_key(ops):
    feed, truth, seen = ChangeFeed(), {}, set()
    for op, n in ops:
        key = b"k%d" % n
        if op == "take":
            changes = feed.take(n + 1)
            assert len(changes) <= n + 1
            assert not set(changes.added) & set(changes.removed)
            seen |= set(changes.added)
            seen -= set(changes.removed)
        else:
            truth[key] = op == "add"
            (feed.added if op == "add" else feed.removed)(key)
    changes = feed.take(100)
    seen |= set(changes.added)
    seen -= set(changes.removed)
    assert seen == {k for k, readable in truth.items() if readable}
    assert len(feed) == 0 and feed.take(1) == TierChanges()


def test_a_changed_key_keeps_its_place_in_the_queue():
    feed = ChangeFeed()
    for key in (b"a", b"b", b"c"):
        feed.added(key)
    feed.removed(b"a")
    assert feed.take(2) == TierChanges(added=(b"b",), removed=(b"a",))
    assert feed.take(5) == TierChanges(added=(b"c",))


@pytest.mark.parametrize("chunk_keys", [1, 1000])
def test_the_inventory_of_a_directory_written_by_others_is_complete(tmp_path, chunk_keys):
    other = make_tier(tmp_path)
    keys = store(other, *range(30))
    other.close()
    os.unlink(other.file_path(keys[0]))  # gone before the new tier starts: not in its list
    tier = make_tier(tmp_path)
    assert sorted(drain(tier, chunk_keys).added) == sorted(keys[1:])
    tier.close()
