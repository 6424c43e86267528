"""Whole-file digests: every byte counts, and a restart over unchanged files reads none."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import xxhash

from kv_offload.runtime.file_digests import CACHE_NAME, FileDigests, digest_file


@pytest.fixture
def weights(tmp_path):
    path = tmp_path / "model" / "shard.bin"
    path.parent.mkdir()
    path.write_bytes(os.urandom(3 << 20))
    return path


def test_the_digest_covers_every_byte_as_an_independent_hash_does(weights):
    assert digest_file(weights) == xxhash.xxh3_128_hexdigest(weights.read_bytes())


def test_a_restart_over_unchanged_files_reads_nothing(weights, tmp_path):
    first = FileDigests(tmp_path / "cache").digests([weights])[0]
    again = FileDigests(tmp_path / "cache").digests([weights])[0]  # (another process)
    assert not first.remembered and again.remembered
    assert again.digest == first.digest


def test_one_byte_edited_in_place_with_its_mtime_restored_is_read_again(weights, tmp_path):
    digests = FileDigests(tmp_path / "cache")
    before = digests.digests([weights])[0]
    st = os.stat(weights)
    with open(weights, "r+b") as f:  # one byte, in the middle
        f.seek(1_234_567)
        byte = f.read(1)
        f.seek(1_234_567)
        f.write(bytes([byte[0] ^ 0x80]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(weights).st_mtime_ns == st.st_mtime_ns  # (only ctime tells)
    after = digests.digests([weights])[0]
    assert not after.remembered
    assert after.digest != before.digest
    assert after.digest == xxhash.xxh3_128_hexdigest(weights.read_bytes())


def test_a_file_replaced_by_rename_is_read_again(weights, tmp_path):
    digests = FileDigests(tmp_path / "cache")
    digests.digests([weights])
    replacement = weights.with_name("new")
    replacement.write_bytes(weights.read_bytes())
    os.replace(replacement, weights)  # (same bytes, another inode)
    again = digests.digests([weights])[0]
    assert not again.remembered


def test_a_damaged_cache_is_ignored_and_rewritten(weights, tmp_path):
    cache = tmp_path / "cache"
    FileDigests(cache).digests([weights])
    (cache / CACHE_NAME).write_text("{not json")
    got = FileDigests(cache).digests([weights])[0]
    assert not got.remembered and got.digest == digest_file(weights)
    assert json.loads((cache / CACHE_NAME).read_text())  # rewritten whole
    assert FileDigests(cache).digests([weights])[0].remembered


def test_the_cache_is_private(weights, tmp_path):
    cache = tmp_path / "cache"
    FileDigests(cache).digests([weights])
    assert os.stat(cache).st_mode & 0o777 == 0o700
    assert os.stat(cache / CACHE_NAME).st_mode & 0o777 == 0o600


def test_an_unwritable_cache_still_gives_digests_and_says_so_once(weights, tmp_path, caplog):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    digests = FileDigests(blocked / "cache")
    with caplog.at_level("WARNING", logger="kv_offload"):
        first = digests.digests([weights, weights])
    assert {d.digest for d in first} == {digest_file(weights)}
    assert not any(d.remembered for d in first)
    said = [r for r in caplog.records if "KV_OFFLOAD_CACHE_DIR" in r.getMessage()]
    assert len(said) == 1


def test_a_directory_or_a_fifo_is_refused_not_read(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        FileDigests(tmp_path / "cache").digests([fifo])


def test_processes_digesting_the_same_file_at_once_read_it_once(weights, tmp_path):
    """The ranks of one engine start together: one reads, the others find its digest."""
    cache = tmp_path / "cache"
    script = (
        "import sys; from pathlib import Path; "
        "from kv_offload.runtime.file_digests import FileDigests; "
        "d = FileDigests(Path(sys.argv[1])).digests([Path(sys.argv[2])])[0]; "
        "print(int(d.remembered), d.digest)")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(cache), str(weights)],
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len({digest for _, digest in outs}) == 1
    assert sorted(int(remembered) for remembered, _ in outs) == [0, 1, 1]
