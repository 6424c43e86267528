"""The filesystem tier across real processes: restart, kill -9, sharing one directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig

from helpers.tier_helpers import child_command, chunk, read, release_together, temp_files

FINGERPRINT = "model-a|tp=1"
SIZE = 64 * 1024 + 17


def run_child(*args: object, timeout: float = 60) -> dict:
    done = subprocess.run(child_command(*args), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def start_child(*args: object, barrier: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, TIER_TEST_BARRIER=barrier) if barrier else None
    return subprocess.Popen(child_command(*args), stdout=subprocess.PIPE, text=True, env=env)


def finish(child: subprocess.Popen, timeout: float = 60) -> dict:
    out, _ = child.communicate(timeout=timeout)
    assert child.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


def make_tier(root, **kw) -> FilesystemTier:
    kw.setdefault("rescan_interval_s", 0)
    return FilesystemTier(FilesystemTierConfig(str(root), FINGERPRINT, 1 << 34, **kw))


def read_index(tier: FilesystemTier, i: int, size: int = SIZE) -> torch.Tensor | None:
    key, _ = chunk(i, size)
    out = torch.empty(size, dtype=torch.uint8)
    return out if read(tier, [key], [out]).ok else None


def visible_indices(root) -> list[int]:
    names = [n for _, _, files in os.walk(root) for n in files if n.endswith(".safetensors")]
    return sorted(int(bytes.fromhex(n.split(".")[0]).decode().split("-")[1]) for n in names)


def test_kill_9_while_writing_leaves_a_clean_consistent_directory(tmp_path):
    writer = start_child("write-forever", tmp_path, FINGERPRINT, 0, 0, 1 << 20, 0)
    confirmed = []
    deadline = time.monotonic() + 60
    while len(confirmed) < 40 and time.monotonic() < deadline:
        confirmed.append(int(writer.stdout.readline()))
    while not temp_files(str(tmp_path)) and time.monotonic() < deadline:
        pass  # kill it mid-write if we can catch one (it fsyncs, so usually within ms)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    writer.stdout.close()
    assert len(confirmed) >= 40
    left_by_crash = len(temp_files(str(tmp_path)))

    tier = make_tier(tmp_path)
    assert temp_files(str(tmp_path)) == []
    assert tier.stats()["temp_files_swept"] == left_by_crash
    visible = visible_indices(tmp_path)
    assert set(confirmed) <= set(visible)
    for i in visible:
        out = read_index(tier, i, 1 << 20)
        assert out is not None and torch.equal(out, chunk(i, 1 << 20)[1]), i
    tier.close()


def test_two_processes_writing_the_same_keys_never_corrupt_them(tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    root = tmp_path / "root"
    writers = [
        start_child("write", root, FINGERPRINT, 0, 60, SIZE, v, barrier=str(barrier))
        for v in (1, 2)
    ]
    release_together(str(barrier), 2)
    reports = [finish(w) for w in writers]
    assert all(r["ok"] == list(range(60)) for r in reports)
    assert temp_files(str(root)) == []
    tier = make_tier(root)
    for i in range(60):
        out = read_index(tier, i)
        assert out is not None
        assert torch.equal(out, chunk(i, SIZE, 1)[1]) or torch.equal(out, chunk(i, SIZE, 2)[1])
    tier.close()


def test_processes_evicting_each_others_files_stay_consistent(tmp_path):
    file_bytes = SIZE + 4096
    budget = 12 * file_bytes
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    root = tmp_path / "root"
    writers = [
        start_child(
            "write", root, FINGERPRINT, first, 40, SIZE, 0, budget, 0.05, barrier=str(barrier)
        )
        for first in (0, 1000)
    ]
    release_together(str(barrier), 2)
    reports = [finish(w) for w in writers]
    assert [len(r["ok"]) for r in reports] == [40, 40]
    assert sum(r["counts"].get("evictions", 0) for r in reports) > 0
    tier = make_tier(root)
    for i in visible_indices(root):
        out = read_index(tier, i)
        assert out is not None and torch.equal(out, chunk(i, SIZE)[1]), i
    assert tier.stats()["read_failed"] == 0
    tier.close()


def test_stores_of_one_process_reach_a_running_one_and_a_restarted_one(tmp_path):
    """Process A stores; a tier already running elsewhere sees the keys within its rescan
    interval; process B, started afterwards, loads everything bit-exact."""
    interval = 0.3
    running = make_tier(tmp_path, rescan_interval_s=interval)
    keys = [chunk(i, SIZE)[0] for i in range(20)]
    assert running.lookup(keys) == [False] * 20
    stored = run_child("write", tmp_path, FINGERPRINT, 0, 20, SIZE, 0)
    assert stored["ok"] == list(range(20))
    written = time.monotonic()
    while not all(running.lookup(keys)):
        # Bound: one interval plus one scan; 3 s of slack for a loaded machine.
        assert time.monotonic() - written < interval + 3.0, "keys never became visible"
        time.sleep(0.01)
    assert all(torch.equal(read_index(running, i), chunk(i, SIZE)[1]) for i in range(20))
    running.close()

    loaded = run_child("read", tmp_path, FINGERPRINT, 0, 20, SIZE, 0)
    assert loaded["ok"] == list(range(20)) and loaded["failed"] == []
    assert loaded["counts"]["read_ok"] == 20


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE (POSIX)")
def test_a_write_the_kernel_refuses_fails_alone(tmp_path):
    """A real kernel write error (EFBIG from RLIMIT_FSIZE in a child) fails only its key."""
    report = run_child("write-fsize-limited", tmp_path, FINGERPRINT, 0, 6, SIZE, 0)
    assert report["ok"] == [0, 2, 4] and report["failed"] == [1, 3, 5]
    assert report["counts"]["write_failed_EFBIG"] == 3
    assert temp_files(str(tmp_path)) == []
    tier = make_tier(tmp_path)
    assert tier.lookup([chunk(i, SIZE)[0] for i in range(6)]) == [True, False] * 3
    assert all(torch.equal(read_index(tier, i), chunk(i, SIZE)[1]) for i in (0, 2, 4))
    tier.close()
