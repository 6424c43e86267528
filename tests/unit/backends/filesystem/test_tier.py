"""Filesystem tier behaviour in one process: persistence, budget and LRU, sweeping, errors."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from kv_offload.backends.base import Repack
from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig
from kv_offload.backends.filesystem.fileformat import data_offset, temp_file_name
from kv_offload.errors import ConfigError, TierRequestError, TierRootError

from helpers.tier_helpers import chunk, read, temp_files, wait, write

FINGERPRINT = "model-a"
SIZE = 8192
FILE = data_offset(b"chunk-0", FINGERPRINT, SIZE) + SIZE  # bytes on disk per chunk


def make_tier(root, budget: int = 1 << 30, **kw) -> FilesystemTier:
    return FilesystemTier(
        FilesystemTierConfig(str(root), FINGERPRINT, budget, rescan_interval_s=0, **kw)
    )


def stored(tier: FilesystemTier, *indices: int) -> None:
    chunks = [chunk(i, SIZE) for i in indices]
    assert write(tier, [k for k, _ in chunks], [d for _, d in chunks]).ok


def reads_back(tier: FilesystemTier, i: int) -> bool:
    key, data = chunk(i, SIZE)
    out = torch.empty(SIZE, dtype=torch.uint8)
    return read(tier, [key], [out]).ok and torch.equal(out, data)


def present(tier: FilesystemTier, *indices: int) -> list[bool]:
    return tier.lookup([chunk(i, SIZE)[0] for i in indices])


def test_a_new_tier_on_the_directory_finds_everything(tmp_path):
    tier = make_tier(tmp_path)
    stored(tier, *range(10))
    tier.close()
    again = make_tier(tmp_path)
    assert again.stats().keys == 10 and again.stats().bytes_used == 10 * FILE
    assert all(reads_back(again, i) for i in range(10))
    again.close()


def test_direct_io_is_used_on_a_real_disk(tmp_path):
    tier = make_tier(tmp_path)
    assert tier.stats().direct_io  # tmp_path is on ext4 here; buffered is covered by the suite
    tier.close()


def test_lru_eviction_by_last_access_survives_a_restart(tmp_path):
    tier = make_tier(tmp_path, budget=3 * FILE)
    for i in range(3):
        stored(tier, i)
        time.sleep(0.02)  # distinct mtimes: a restart orders the LRU by them
    assert reads_back(tier, 0)  # 0 becomes the most recent
    time.sleep(0.02)
    stored(tier, 3)
    assert present(tier, 0, 1, 2, 3) == [True, False, True, True]
    assert not os.path.exists(tier.file_path(chunk(1, SIZE)[0]))
    assert tier.stats()["evictions"] == 1
    tier.close()
    again = make_tier(tmp_path, budget=3 * FILE)
    stored(again, 4)  # the least recent on disk is 2 (0 was read after 2 was written)
    assert present(again, 0, 2, 3, 4) == [True, False, True, True]
    again.close()


def test_a_smaller_budget_at_start_evicts_down_to_it(tmp_path):
    tier = make_tier(tmp_path)
    stored(tier, *range(5))
    tier.close()
    small = make_tier(tmp_path, budget=2 * FILE)
    assert small.stats().keys == 2 and small.stats().bytes_used <= 2 * FILE
    assert sum(1 for d, _, n in os.walk(tmp_path) for f in n if f.endswith(".safetensors")) == 2
    small.close()


def test_a_chunk_larger_than_the_budget_fails_alone(tmp_path):
    tier = make_tier(tmp_path, budget=2 * FILE)
    big = torch.zeros(3 * FILE, dtype=torch.uint8)
    key0, data0 = chunk(0, SIZE)
    result = write(tier, [b"big", key0], [big, data0])
    assert result.succeeded == (False, True)
    assert tier.stats()["write_failed_budget"] == 1
    assert reads_back(tier, 0)
    tier.close()


def test_temporary_files_of_dead_writers_here_go_at_start_and_others_once_left_unchanged(
    tmp_path,
):
    """A writer of this host that is gone leaves a temporary file that is swept at once; any
    other is swept only once this tier saw it unchanged for ``stale_temp_s``, whatever its
    time stamp says (another host's clock may be a day off either way), and never while it
    is still being written."""
    tier = make_tier(tmp_path)
    stored(tier, 0)
    tier.close()
    fanout = os.path.dirname(tier.file_path(chunk(0, SIZE)[0]))
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            "dead writer here": temp_file_name(int(dead.stdout), "a", host),
            "live writer here": temp_file_name(alive.pid, "b", host),
            "a day behind, left": temp_file_name(1, "c", "elsewhere"),
            "a day ahead, left": temp_file_name(1, "d", "elsewhere"),
            "a day behind, being written": temp_file_name(1, "e", "elsewhere"),
        }
        for label, name in names.items():
            with open(os.path.join(fanout, name), "wb") as f:
                f.write(b"partial")
            then = time.time() + (86400 if "ahead" in label else -86400)
            os.utime(os.path.join(fanout, name), (then, then))
        stale_temp_s = 0.4
        again = make_tier(tmp_path, stale_temp_s=stale_temp_s)
        started = time.monotonic()
        left = {os.path.basename(p) for p in temp_files(str(tmp_path))}
        assert left == set(names.values()) - {names["dead writer here"]}
        assert again.stats()["temp_files_swept"] == 1
        being_written = os.path.join(fanout, names["a day behind, being written"])
        deadline = started + 15
        while again.stats()["temp_files_swept"] < 4:
            assert time.monotonic() < deadline, "temporary files left unchanged were kept"
            with open(being_written, "ab") as f:  # (its writer, stamping a day behind)
                f.write(b"more")
            then = time.time() - 86400
            os.utime(being_written, (then, then))
            again.rescan()
            time.sleep(0.05)
        assert time.monotonic() - started >= stale_temp_s
        left = {os.path.basename(p) for p in temp_files(str(tmp_path))}
        assert left == {names["a day behind, being written"]}
        assert reads_back(again, 0)
        again.close()
    finally:
        alive.kill()
        alive.wait()


def test_rescan_adopts_keys_of_others_and_drops_deleted_ones(tmp_path):
    mine, other = make_tier(tmp_path), make_tier(tmp_path)
    stored(mine, 0)
    stored(other, 1)
    assert present(mine, 0, 1) == [True, False]
    os.unlink(mine.file_path(chunk(0, SIZE)[0]))
    mine.rescan()
    assert present(mine, 0, 1) == [False, True]
    assert reads_back(mine, 1)
    assert mine.stats()["keys_adopted"] == 1 and mine.stats()["keys_vanished"] == 1
    mine.close()
    other.close()


def test_a_removed_fanout_directory_is_recreated_on_write(tmp_path):
    tier = make_tier(tmp_path)
    key, _ = chunk(0, SIZE)
    shutil.rmtree(os.path.dirname(tier.file_path(key)))
    stored(tier, 0)
    assert reads_back(tier, 0)
    tier.close()


def test_keys_too_long_for_a_file_name_are_refused(tmp_path):
    tier = make_tier(tmp_path)
    with pytest.raises(TierRequestError, match="at most 100"):
        tier.submit_write([b"k" * 101], [torch.zeros(4, dtype=torch.uint8)])
    tier.close()


def test_a_root_that_is_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(TierRootError, match="not a directory"):
        make_tier(tmp_path / "file")
    with pytest.raises(TierRootError, match="not usable"):
        make_tier(tmp_path / "file" / "below")


def test_a_missing_root_is_created(tmp_path):
    tier = make_tier(tmp_path / "a" / "b")
    stored(tier, 0)
    assert reads_back(tier, 0)
    tier.close()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("bytes_to_use", 0, "bytes_to_use must be a positive int"),
        ("bytes_to_use", 1.5, "bytes_to_use must be a positive int"),
        ("layout_fingerprint", "", "layout_fingerprint must be a non-empty str"),
        ("root_dir", "", "root_dir must be a non-empty path"),
        ("io_threads", 0, "io_threads must be a positive int"),
        ("rescan_interval_s", -1, "rescan_interval_s must be a number >= 0"),
    ],
)
def test_bad_config_values_are_named(tmp_path, field, value, message):
    args = {"root_dir": str(tmp_path), "layout_fingerprint": "fp", "bytes_to_use": 1 << 20}
    args[field] = value
    with pytest.raises(ConfigError, match=message):
        FilesystemTierConfig(**args)


class Reversed(Repack):
    """A value stored back to front: what a repacking tier writes is `pack`'s output."""

    def __init__(self, host: torch.Tensor, fail_unpack: bool = False) -> None:
        self.host, self.nbytes, self.fail_unpack = host, host.numel(), fail_unpack

    def pack(self, out: torch.Tensor) -> None:
        out.copy_(self.host.flip(0))

    def unpack(self, stored: torch.Tensor) -> None:
        if self.fail_unpack:
            raise RuntimeError("unpack failed")
        self.host.copy_(stored.flip(0))


def test_repacked_values_are_stored_as_packed_and_read_back_unpacked(tmp_path):
    tier = make_tier(tmp_path, io_threads=2)
    chunks = [chunk(i, SIZE) for i in range(6)]
    keys = [k for k, _ in chunks]
    job = tier.submit_write_repacked(keys[:5], [Reversed(d.clone()) for _, d in chunks[:5]])
    assert wait(tier, [job])[job].ok
    assert write(tier, keys[5:], [chunks[5][1]]).ok  # a plain value beside them
    out = torch.empty(SIZE, dtype=torch.uint8)  # a plain read sees the stored (packed) bytes
    assert read(tier, [keys[0]], [out]).ok and torch.equal(out, chunks[0][1].flip(0))
    outs = [torch.zeros(SIZE, dtype=torch.uint8) for _ in chunks]
    job = tier.submit_read_repacked(keys, [*map(Reversed, outs[:5]), outs[5]])
    assert wait(tier, [job])[job].ok
    assert all(torch.equal(o, d) for o, (_, d) in zip(outs, chunks))
    job = tier.submit_read_repacked(keys[:1], [Reversed(outs[0], fail_unpack=True)])
    assert wait(tier, [job])[job].succeeded == (False,)  # a failing unpack fails its key
    with pytest.raises(TierRequestError, match="repacks 0 bytes"):
        tier.submit_write_repacked([b"k"], [Reversed(torch.empty(0, dtype=torch.uint8))])
    with pytest.raises(TierRequestError, match="got Reversed"):  # plain submits take buffers
        tier.submit_write([b"k"], [Reversed(outs[0])])
    tier.close()
