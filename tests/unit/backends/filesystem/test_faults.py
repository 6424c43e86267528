"""The fault table of the filesystem tier, on real files.

Each fault hits one key's file; then one read job asks for that key and two healthy ones. For
every fault: no exception escapes, the damaged key reads as failed (and is a miss afterwards,
its file removed), and the healthy keys read bit-exact. Run by the tier that wrote the files,
and by a fresh tier on the same directory (as after a restart).
"""

from __future__ import annotations

import os
import shutil
import struct

import pytest
import torch

from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig

from helpers.tier_helpers import chunk, read, write

FINGERPRINT = "model-a|LBHNC|page=16384"
SIZE = 3 * 4096 + 123  # an aligned body and a tail


def flip_bit(path: str, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def header_bytes(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def json_offset(path: str, text: bytes) -> int:
    with open(path, "rb") as f:
        return f.read(header_bytes(path)).index(text)


def foreign_layout_file(path: str, key: bytes, root: str) -> None:
    """Replace the file by one another layout wrote for the same key and size."""
    other = FilesystemTier(FilesystemTierConfig(root, "model-b|LBHNC|page=16384", 1 << 30))
    _, data = chunk(0, SIZE, variant=9)
    assert write(other, [key], [data]).ok
    other.close()
    shutil.copyfile(other.file_path(key), path)


def _append(path: str, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def _overwrite(path: str, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.write(data)


FAULTS = {
    "bit flip in data": lambda p, k, r: flip_bit(p, header_bytes(p) + 5000, 3),
    "bit flip in last data byte": lambda p, k, r: flip_bit(p, os.path.getsize(p) - 1, 7),
    "bit flip in length prefix": lambda p, k, r: flip_bit(p, 0, 0),
    "bit flip in header checksum": lambda p, k, r: flip_bit(p, json_offset(p, b"xxh3_64:") + 9),
    "bit flip in header key": lambda p, k, r: flip_bit(p, json_offset(p, b'"key"') + 8, 1),
    "bit flip in header padding": lambda p, k, r: flip_bit(p, header_bytes(p) - 2, 0),
    "truncated data": lambda p, k, r: os.truncate(p, os.path.getsize(p) - 1),
    "truncated header": lambda p, k, r: os.truncate(p, 100),
    "empty file": lambda p, k, r: os.truncate(p, 0),
    "extra bytes": lambda p, k, r: _append(p, b"\0" * 10),
    "zeroed file": lambda p, k, r: _overwrite(p, bytes(os.path.getsize(p))),
    "missing file": lambda p, k, r: os.unlink(p),
    "file of another layout": foreign_layout_file,
}


def make_tier(root: str, **kw) -> FilesystemTier:
    return FilesystemTier(FilesystemTierConfig(root, FINGERPRINT, 1 << 30, **kw))


@pytest.mark.parametrize("reader", ["same tier", "fresh tier"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_damaged_file_is_a_failed_key_and_is_removed(tmp_path, fault, reader):
    root = str(tmp_path)
    tier = make_tier(root)
    chunks = [chunk(i, SIZE) for i in range(3)]
    assert write(tier, [k for k, _ in chunks], [d for _, d in chunks]).ok
    bad_key = chunks[1][0]
    path = tier.file_path(bad_key)
    FAULTS[fault](path, bad_key, root)
    if reader == "fresh tier":
        tier.close()
        tier = make_tier(root)
    outs = [torch.zeros(SIZE, dtype=torch.uint8) for _ in chunks]
    result = read(tier, [k for k, _ in chunks], outs)
    assert result.succeeded == (True, False, True)
    assert torch.equal(outs[0], chunks[0][1]) and torch.equal(outs[2], chunks[2][1])
    assert tier.lookup([k for k, _ in chunks]) == [True, False, True]
    assert not os.path.exists(path)
    stats = tier.stats()
    if fault == "missing file":
        assert stats["read_failed_vanished"] + stats["read_failed_absent"] == 1
    else:
        assert stats["bad_files_removed"] == 1
    # The key can be stored again and then reads fine.
    assert write(tier, [bad_key], [chunks[1][1]]).ok
    again = torch.zeros(SIZE, dtype=torch.uint8)
    assert read(tier, [bad_key], [again]).ok and torch.equal(again, chunks[1][1])
    tier.close()


def test_an_unaligned_buffer_with_a_corrupt_file_also_fails_cleanly(tmp_path):
    tier = make_tier(str(tmp_path))
    key, data = chunk(0, SIZE)
    assert write(tier, [key], [data]).ok
    flip_bit(tier.file_path(key), header_bytes(tier.file_path(key)) + 1)
    pool = torch.zeros(SIZE + 1, dtype=torch.uint8)
    assert read(tier, [key], [pool[1:]]).succeeded == (False,)
    assert tier.stats()["bad_files_removed"] == 1
    tier.close()


def test_files_of_another_layout_are_invisible_and_not_counted(tmp_path):
    a = make_tier(str(tmp_path))
    key, data = chunk(0, SIZE)
    assert write(a, [key], [data]).ok
    b = FilesystemTier(FilesystemTierConfig(str(tmp_path), "model-b", 1 << 30))
    assert b.lookup([key]) == [False]
    assert b.stats().bytes_used == 0
    out = torch.zeros(SIZE, dtype=torch.uint8)
    assert read(b, [key], [out]).succeeded == (False,)
    assert os.path.exists(a.file_path(key))
    a.close()
    b.close()
