"""A full disk: a write that fails for lack of space keeps the files it was going to evict,
and write failures are counted by reason and logged once per episode.

The genuinely full filesystem is a small tmpfs (needs root with mount privileges; the test
skips and says why without them). The kernel's file-size limit (RLIMIT_FSIZE, in a child
process) refuses a write the same way on any POSIX system and runs everywhere.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections import Counter

import pytest
import torch

from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig
from kv_offload.backends.filesystem.episodes import FailureEpisodes
from kv_offload.backends.filesystem.fileformat import data_offset

from helpers.tier_helpers import HERE, chunk, read, temp_files, write
from unit.backends.filesystem.test_mounts import mounter  # noqa: F401 (a fixture)

FINGERPRINT = "model-a"
SIZE = 256 * 1024
FILE = data_offset(b"chunk-0", FINGERPRINT, SIZE) + SIZE
LOGGER = "kv_offload.backends.filesystem"


def fill(path: str) -> None:
    """Write ``path`` until the filesystem has no byte left."""
    with open(path, "wb", buffering=0) as f:
        piece = b"\0" * 4096
        while True:
            try:
                f.write(piece)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                return


def reads_back(tier: FilesystemTier, i: int) -> bool:
    key, data = chunk(i, SIZE)
    out = torch.empty(SIZE, dtype=torch.uint8)
    return read(tier, [key], [out]).ok and torch.equal(out, data)


def warnings_from(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith(LOGGER) and r.levelno >= logging.WARNING]


def test_a_write_that_finds_the_disk_full_keeps_the_files_it_would_have_evicted(
    tmp_path, mounter, caplog  # noqa: F811
):
    small = tmp_path / "small"
    small.mkdir()
    mounter("-t", "tmpfs", "-o", "size=2m", "tmpfs", target=small)
    tier = FilesystemTier(
        FilesystemTierConfig(str(small / "root"), FINGERPRINT, 4 * FILE, rescan_interval_s=0)
    )
    for i in range(4):
        assert write(tier, [chunk(i, SIZE)[0]], [chunk(i, SIZE)[1]]).ok
    fill(str(small / "ballast"))  # someone else fills the disk
    caplog.set_level(logging.INFO, logger=LOGGER)

    for i in (4, 5, 6):  # each needs one victim under the budget; none fits on the disk
        assert write(tier, [chunk(i, SIZE)[0]], [chunk(i, SIZE)[1]]).succeeded == (False,)
    stats = tier.stats()
    assert (stats["write_failed"], stats["write_failed_ENOSPC"]) == (3, 3)
    assert stats["write_failure_episodes"] == 1 and stats["evictions"] == 0
    logged = warnings_from(caplog)
    assert len(logged) == 1 and "ENOSPC" in logged[0]  # one line for the episode
    assert tier.lookup([chunk(i, SIZE)[0] for i in range(7)]) == [True] * 4 + [False] * 3
    assert all(reads_back(tier, i) for i in range(4))  # the would-be victims are intact
    assert temp_files(str(small)) == []

    os.unlink(small / "ballast")  # space comes back
    assert write(tier, [chunk(4, SIZE)[0]], [chunk(4, SIZE)[1]]).ok
    logged = warnings_from(caplog)
    assert len(logged) == 2 and "work again after 3 failed" in logged[1]
    # The reads above went 0, 1, 2, 3: chunk 0 is the least recent, evicted once 4 landed.
    assert tier.lookup([chunk(i, SIZE)[0] for i in range(5)]) == [False] + [True] * 4
    assert not os.path.exists(tier.file_path(chunk(0, SIZE)[0]))
    assert reads_back(tier, 4)
    assert tier.stats()["evictions"] == 1
    tier.close()


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE (POSIX)")
def test_a_write_the_kernel_refuses_keeps_the_files_it_would_have_evicted(tmp_path):
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "fs_children.py"), "evict-then-refused",
         str(tmp_path), str(64 * 1024)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["stored"] == [True] * 6
    assert report["big_write_ok"] is False
    assert report["counts"]["write_failed_EFBIG"] == 1
    assert report["counts"].get("evictions", 0) == 0
    assert report["present"] == report["files"] == report["intact"] == [True] * 6


def test_failures_are_logged_once_per_episode_and_counted_by_reason(caplog):
    counts: Counter[str] = Counter()
    episodes = FailureEpisodes("write", counts, threading.Lock(), logging.getLogger(LOGGER))
    caplog.set_level(logging.INFO, logger=LOGGER)
    episodes.succeeded()  # nothing to end
    for reason in ("ENOSPC", "ENOSPC", "EIO"):
        episodes.failed(reason, "key 00")
    episodes.succeeded()
    episodes.succeeded()
    episodes.failed("EIO", "key 01")
    assert warnings_from(caplog) == [
        "kv-offload: write failed (ENOSPC): key 00; further write failures are counted, not "
        "logged, until one succeeds",
        "kv-offload: writes work again after 3 failed",
        "kv-offload: write failed (EIO): key 01; further write failures are counted, not "
        "logged, until one succeeds",
    ]
    assert counts == Counter(write_failed=4, write_failed_ENOSPC=2, write_failed_EIO=2,
                             write_failure_episodes=2)
    assert episodes.ongoing
