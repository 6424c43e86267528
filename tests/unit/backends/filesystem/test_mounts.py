"""The filesystem tier on real special filesystems: full, read-only, without O_DIRECT.

These mount small filesystems (tmpfs, ramfs, a read-only bind mount), which needs root with
mount privileges; without them the tests skip and say why. The unprivileged cousin of the
full-disk test (a kernel file-size limit) runs everywhere, in test_filesystem_processes.py.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig, aligned_host_buffer
from kv_offload.backends.filesystem.fileformat import build_header
from kv_offload.backends.filesystem.io_engine import IOEngine
from kv_offload.errors import TierRootError

from helpers.tier_helpers import chunk, read, temp_files, write

FINGERPRINT = "model-a"


def make_tier(root) -> FilesystemTier:
    return FilesystemTier(
        FilesystemTierConfig(str(root), FINGERPRINT, 1 << 30, rescan_interval_s=0)
    )


@pytest.fixture
def mounter():
    """mount(*args, target): mounts for the test, unmounted after it; skips when not allowed."""
    mounted = []

    def mount(*args: str, target) -> None:
        done = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount here (needs root with mount privileges): {done.stderr}")
        mounted.append(str(target))

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", target], check=False)


def test_a_full_disk_fails_the_writes_that_do_not_fit_and_nothing_else(tmp_path, mounter):
    small = tmp_path / "small"
    small.mkdir()
    mounter("-t", "tmpfs", "-o", "size=1m", "tmpfs", target=small)
    tier = make_tier(small)
    size = 256 * 1024
    chunks = [chunk(i, size) for i in range(6)]  # 6 x 260 KiB on a 1 MiB filesystem
    result = write(tier, [k for k, _ in chunks], [d for _, d in chunks])
    failed = result.succeeded.count(False)
    assert 1 <= failed <= 4
    assert tier.stats()["write_failed_ENOSPC"] == failed
    assert temp_files(str(small)) == []
    assert tier.lookup([k for k, _ in chunks]) == list(result.succeeded)
    for (key, data), ok in zip(chunks, result.succeeded):
        if ok:
            out = torch.empty(size, dtype=torch.uint8)
            assert read(tier, [key], [out]).ok and torch.equal(out, data)
    # Once space is freed (here: another process deleted a file), writes work again.
    gone = next(k for (k, _), ok in zip(chunks, result.succeeded) if ok)
    os.unlink(tier.file_path(gone))
    tier.rescan()
    retry = next(i for i, ok in enumerate(result.succeeded) if not ok)
    assert write(tier, [chunks[retry][0]], [chunks[retry][1]]).ok
    tier.close()


def make_read_only(path, mounter) -> None:
    if os.geteuid() != 0:
        for d, _, _ in os.walk(path):
            os.chmod(d, 0o555)
        return
    # Root ignores permission bits, so chmod would prove nothing: use a read-only bind mount.
    mounter("--bind", str(path), target=path)
    mounter("-o", "remount,bind,ro", str(path), target=path)


def test_a_read_only_root_refuses_writes_serves_reads_and_cannot_start(tmp_path, mounter):
    root = tmp_path / "root"
    tier = make_tier(root)
    chunks = [chunk(i, 5000) for i in range(3)]
    assert write(tier, [chunks[0][0], chunks[1][0]], [chunks[0][1], chunks[1][1]]).ok
    make_read_only(root, mounter)
    assert write(tier, [chunks[2][0]], [chunks[2][1]]).succeeded == (False,)
    stats = tier.stats()
    assert stats["write_failed"] == 1
    assert stats["write_failed_EROFS"] + stats["write_failed_EACCES"] == 1
    assert tier.lookup([k for k, _ in chunks]) == [True, True, False]
    for key, data in chunks[:2]:
        out = torch.empty(5000, dtype=torch.uint8)
        assert read(tier, [key], [out]).ok and torch.equal(out, data)
    tier.close()
    with pytest.raises(TierRootError, match="not usable"):
        make_tier(root)


def test_without_o_direct_the_tier_falls_back_to_buffered_io(tmp_path, mounter):
    ram = tmp_path / "ram"
    ram.mkdir()
    mounter("-t", "ramfs", "ramfs", target=ram)  # ramfs refuses O_DIRECT with EINVAL
    tier = make_tier(ram)
    assert not tier.stats().direct_io
    key, data = chunk(0, 3 * 4096 + 5)
    assert write(tier, [key], [data]).ok
    out = aligned_host_buffer(data.numel())
    assert read(tier, [key], [out]).ok and torch.equal(out, data)
    tier.close()

    # An engine told to use O_DIRECT there hits EINVAL, retries buffered, and stays buffered.
    engine = IOEngine(direct=True, fsync=False)
    src = aligned_host_buffer(8192)
    src.copy_(data[:8192])
    header = build_header(b"k", FINGERPRINT, 8192, "0" * 16)
    engine.write_new(str(ram / "tmp"), str(ram / "final"), header, src)
    assert (engine.direct, engine.direct_fallbacks) == (False, 1)
    back = aligned_host_buffer(8192)
    assert engine.read(str(ram / "final"), len(header), back) == header
    assert torch.equal(back, src)
