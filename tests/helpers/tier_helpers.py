"""Helpers shared by the storage-tier tests, and a child-process entry point for them.

``python tier_helpers.py <command> ...`` runs one side of a multi-process test (writer, reader,
writer killed mid-loop, writer under a file-size limit) in a genuinely separate process.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch

from kv_offload.backends.base import StorageTier, TierJobResult

HERE = os.path.dirname(os.path.abspath(__file__))


def random_bytes(n: int, seed: int) -> torch.Tensor:
    """``n`` reproducible pseudo-random bytes (the same in every process)."""
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def chunk(index: int, size: int, variant: int = 0) -> tuple[bytes, torch.Tensor]:
    """Key and data of chunk ``index``; ``variant`` gives other bytes for the same key."""
    return f"chunk-{index}".encode(), random_bytes(size, index * 1000 + variant)


def wait(tier: StorageTier, job_ids: list[int], timeout: float = 30.0) -> dict[int, TierJobResult]:
    """Poll until every job id came back; fail on a duplicate or an unknown id."""
    results: dict[int, TierJobResult] = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(job_ids):
        for result in tier.poll():
            assert result.job_id in job_ids and result.job_id not in results
            results[result.job_id] = result
        assert time.monotonic() < deadline, f"jobs {set(job_ids) - set(results)} never finished"
        time.sleep(0.002)
    return results


def write(tier: StorageTier, keys: list[bytes], bufs: list[torch.Tensor]) -> TierJobResult:
    job = tier.submit_write(keys, bufs)
    return wait(tier, [job])[job]


def read(tier: StorageTier, keys: list[bytes], bufs: list[torch.Tensor]) -> TierJobResult:
    job = tier.submit_read(keys, bufs)
    return wait(tier, [job])[job]


def temp_files(root: str) -> list[str]:
    """Temporary files of the filesystem tier anywhere under ``root``."""
    return [
        os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.startswith(".tmp.")
    ]


def child_command(*args: object) -> list[str]:
    return [sys.executable, os.path.join(HERE, "tier_helpers.py"), *map(str, args)]


def release_together(barrier: str, children: int, timeout: float = 60.0) -> None:
    """Wait until ``children`` started with TIER_TEST_BARRIER=barrier are ready; let them go."""
    deadline = time.monotonic() + timeout
    while sum(n.startswith("ready-") for n in os.listdir(barrier)) < children:
        assert time.monotonic() < deadline, "child processes never got ready"
        time.sleep(0.01)
    open(os.path.join(barrier, "go"), "w").close()


def _main(argv: list[str]) -> None:
    from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig

    command, root, fingerprint, first, count, size, variant = argv[:7]
    first, count, size, variant = int(first), int(count), int(size), int(variant)
    budget = int(argv[7]) if len(argv) > 7 else 1 << 34
    rescan_interval_s = float(argv[8]) if len(argv) > 8 else 0.0
    if command == "write-fsize-limited":
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 8192, size + 8192))
    # The killed writer fsyncs: its temporary files then live long enough to be cut short.
    tier = FilesystemTier(
        FilesystemTierConfig(
            root,
            fingerprint,
            budget,
            rescan_interval_s=rescan_interval_s,
            fsync=command == "write-forever",
        )
    )
    report: dict = {"ok": [], "failed": []}
    barrier = os.environ.get("TIER_TEST_BARRIER")
    if barrier:  # start writing together with the other children: announce, wait for "go"
        open(os.path.join(barrier, f"ready-{os.getpid()}"), "w").close()
        while not os.path.exists(os.path.join(barrier, "go")):
            time.sleep(0.001)
    if command in ("write", "write-fsize-limited"):
        for i in range(first, first + count):
            n = size * 4 if command == "write-fsize-limited" and i % 2 else size
            key, data = chunk(i, n, variant)
            result = write(tier, [key], [data])
            report["ok" if result.ok else "failed"].append(i)
    elif command == "write-forever":  # until killed: jobs of 8 keys, one line per stored key
        for batch in range(first, 10**9, 8):
            chunks = [chunk(i, size, variant) for i in range(batch, batch + 8)]
            result = write(tier, [k for k, _ in chunks], [d for _, d in chunks])
            for i, ok in zip(range(batch, batch + 8), result.succeeded):
                if ok:
                    print(i, flush=True)
    elif command == "read":
        for i in range(first, first + count):
            key, expected = chunk(i, size, variant)
            out = torch.empty(size, dtype=torch.uint8)
            good = read(tier, [key], [out]).ok and torch.equal(out, expected)
            report["ok" if good else "failed"].append(i)
    report["counts"] = tier.stats().counts
    tier.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])


def drain_changes(tier) -> tuple[set[bytes], set[bytes]]:
    """Everything ``take_changes`` has to report now: (added, removed)."""
    added: set[bytes] = set()
    removed: set[bytes] = set()
    while changes := tier.take_changes(1000):
        added |= set(changes.added)
        removed |= set(changes.removed)
    return added, removed
