"""The disk tier's files are private whatever the umask, and nothing that is not a regular file
(a FIFO planted in a shared directory) can block a read or the process's exit."""

from __future__ import annotations

import os
import stat
import threading
import time

import torch

from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig
from kv_offload.backends.filesystem.root_budget import HEARTBEAT_NAME

from helpers.tier_helpers import chunk, read, write

FINGERPRINT = "model-a"
SIZE = 8192


def make_tier(root) -> FilesystemTier:
    return FilesystemTier(FilesystemTierConfig(str(root), FINGERPRINT, 1 << 30,
                                               rescan_interval_s=0))


def mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_files_are_0600_and_directories_0700_even_with_a_permissive_umask(tmp_path):
    root = tmp_path / "new" / "root"  # parents the tier creates too
    old = os.umask(0o000)
    try:
        tier = make_tier(root)
        key, data = chunk(1, SIZE)
        assert write(tier, [key], [data]).ok
        tier.rescan()  # writes the heartbeat
        tier.close()
    finally:
        os.umask(old)
    made_dirs = [str(tmp_path / "new"), str(root)]
    made_files = []
    for where, dirs, files in os.walk(root):
        made_dirs += [os.path.join(where, d) for d in dirs]
        made_files += [os.path.join(where, f) for f in files]
    assert len(made_dirs) > 256 and len(made_files) == 2  # the fan-out; a record, a heartbeat
    assert any(f.endswith(HEARTBEAT_NAME) for f in made_files)
    assert {p: mode(p) for p in made_dirs} == {p: 0o700 for p in made_dirs}
    assert {p: mode(p) for p in made_files} == {p: 0o600 for p in made_files}


def test_a_fifo_under_a_keys_name_is_a_miss_at_once_and_is_removed(tmp_path):
    tier = make_tier(tmp_path)
    key, data = chunk(2, SIZE)
    assert write(tier, [key], [data]).ok
    path = tier.file_path(key)
    os.unlink(path)
    os.mkfifo(path, 0o600)

    def unblock_a_stuck_reader() -> None:  # (so that the code before the fix fails, not hangs)
        time.sleep(8)
        if os.path.exists(path) and stat.S_ISFIFO(os.lstat(path).st_mode):
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)

    threading.Thread(target=unblock_a_stuck_reader, daemon=True).start()
    out = torch.empty(SIZE, dtype=torch.uint8)
    start = time.monotonic()
    result = read(tier, [key], [out])
    took = time.monotonic() - start
    assert result.succeeded == (False,)
    assert took < 5.0, f"a read of a FIFO took {took:.1f} s"  # (a stuck reader: 8 s)
    assert not os.path.exists(path) and tier.lookup([key]) == [False]
    assert tier.stats()["bad_files_removed"] == 1
    start = time.monotonic()
    tier.close()
    assert time.monotonic() - start < 2.0


def test_a_header_of_deeply_nested_json_is_a_miss_and_the_file_is_removed(tmp_path):
    tier = make_tier(tmp_path)
    key, data = chunk(3, SIZE)
    assert write(tier, [key], [data]).ok
    path = tier.file_path(key)
    header_len = os.path.getsize(path) - SIZE - 8  # same size: only the header check can tell
    nested = (b"[" * 2000 + b"]" * 2000).ljust(header_len)
    with open(path, "wb") as f:
        f.write(header_len.to_bytes(8, "little") + nested + bytes(SIZE))
    out = torch.empty(SIZE, dtype=torch.uint8)
    assert read(tier, [key], [out]).succeeded == (False,)
    assert not os.path.exists(path) and tier.lookup([key]) == [False]
    assert tier.stats()["bad_files_removed"] == 1
    tier.close()
