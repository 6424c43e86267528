"""The step-cost benchmark over a real shared store: `--tier valkey` (issue 25).

Instead of the synthetic index, the worker's storage tier is a real `ValkeyTier` on a real
`redis-server` on loopback that already holds the benchmark's inventory (1,000,000 keys by
default), so whatever the tier does in the engine's process while the engine steps — the
start-up SCAN's inventory streaming to the scheduler, the keyspace notifications of other
engines' writes, the paced SCAN — is in the measured step times.

- The inventory: the documents' blocks are written as real records by a `ValkeyTier` (they
  are loaded by the requests that read documents); the other keys are filler with a 1-byte
  value (never read: the requests never ask for them), loaded with ``redis-cli --pipe``.
- While the engine steps, another process (``writer``: another engine) writes new blocks at
  ``--writer-rate`` keys per second through its own `ValkeyTier`: the tier under test hears
  of each one by its keyspace notification.
- After the steps, the delay until other engines' writes are found: a writer process writes
  ``--delay-keys`` keys, noting when each write returned, while this process polls
  `lookup` every 2 ms (the engine is stopped then: the probe measures the tier, not a
  busy interpreter).

    python benchmarks/bench_step_cost.py --tier valkey --skip-prefill --json step-cost-valkey.json
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kv_offload.backends.valkey import ValkeyTier
from kv_offload.backends.valkey.config import ValkeyTierConfig
from kv_offload.backends.valkey.local_cluster import cli_binary
from kv_offload.backends.valkey.local_server import LocalServer

FINGERPRINT = "step-cost-bench|LBHNC|tp1|rank0"
PREFIX = "bench:"
# Helpers (the loader, the other engine) need no notifications; a tree from before them
# (--before) has no such option.
QUIET = {"keyspace_events": False} if "keyspace_events" in \
    ValkeyTierConfig.__dataclass_fields__ else {}


def _options(url: str, **extra) -> dict:
    return {"url": url, "key_prefix": PREFIX, **extra}


@dataclass
class SharedTierRun:
    """A server holding the inventory, the tier under test on it, and a writer process."""

    server: LocalServer
    tier: ValkeyTier
    block_bytes: int
    start_up_s: float
    fill_s: float
    writer: subprocess.Popen | None = None
    delays_s: list[float] = field(default_factory=list)
    final_counts: dict = field(default_factory=dict)

    def inventory_left(self) -> int:
        return 0  # (the start-up SCAN put the whole inventory in the view)

    def counts(self) -> dict:
        return dict(self.tier.stats().counts)

    def start_writer(self, rate: float) -> None:
        if rate > 0:
            self.writer = subprocess.Popen(
                [sys.executable, __file__, "writer", self.server.url, str(self.block_bytes),
                 str(rate), "0"])

    def stop_writer(self) -> None:
        if self.writer is not None:
            self.writer.send_signal(signal.SIGTERM)
            self.writer.wait(30)
            self.writer = None

    def measure_delay(self, keys: int) -> dict:
        """Another engine writes ``keys`` keys; how long until `lookup` finds each."""
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "written.jsonl"
            proc = subprocess.Popen([sys.executable, __file__, "writer", self.server.url,
                                     str(self.block_bytes), "50", str(keys), str(log)])
            seen: dict[str, float] = {}
            written: dict[str, float] = {}
            deadline = time.time() + 120
            while (len(seen) < keys or proc.poll() is None) and time.time() < deadline:
                if log.exists():
                    for line in log.read_text().split("\n")[:-1]:  # (whole lines only)
                        entry = json.loads(line)
                        written[entry["key"]] = entry["t"]
                todo = [k for k in written if k not in seen]
                if todo:
                    found = self.tier.lookup([bytes.fromhex(k) for k in todo])
                    now = time.time()
                    seen.update((k, now) for k, hit in zip(todo, found) if hit)
                time.sleep(0.002)
            proc.wait(30)
        self.delays_s = sorted(seen[k] - written[k] for k in seen if k in written)
        missing = len(written) - len(seen)
        pick = lambda q: self.delays_s[min(len(self.delays_s) - 1,  # noqa: E731
                                          int(q * len(self.delays_s)))]
        return {"keys": len(written), "not_found": missing,
                "p50_ms": pick(0.5) * 1e3, "p99_ms": pick(0.99) * 1e3,
                "max_ms": self.delays_s[-1] * 1e3} if self.delays_s else {"keys": 0}

    def close(self) -> None:
        self.final_counts = self.counts()
        self.stop_writer()
        self.tier.close()
        self.server.stop()


def start_valkey(inventory: list[bytes], documents: set[bytes], block_bytes: int,
                 maxmemory: str = "4gb") -> SharedTierRun:
    """A server holding ``inventory`` (``documents`` as real records, the rest filler) and
    the tier under test on it, its start-up SCAN done."""
    server = LocalServer(maxmemory=maxmemory)
    started = time.monotonic()
    loader = ValkeyTier.from_options(_options(server.url, refresh_interval_s=0, **QUIET),
                                     FINGERPRINT)
    prefix = loader._prefix
    _pipe_filler(server, [prefix + k.hex().encode() for k in inventory if k not in documents])
    docs = sorted(documents)
    for i in range(0, len(docs), 512):
        chunk = docs[i:i + 512]
        job = loader.submit_write(chunk, [_block(k, block_bytes) for k in chunk])
        _wait(loader, job)
    loader.close()
    fill_s = time.monotonic() - started
    started = time.monotonic()
    tier = ValkeyTier.from_options(_options(server.url), FINGERPRINT)
    return SharedTierRun(server, tier, block_bytes, time.monotonic() - started, fill_s)


def print_shared(steps: dict) -> None:
    """The shared-store lines of the benchmark's per-step table."""
    shared, counts = steps["shared"], steps["tier"]
    print(f"  {shared['kind']}: {steps['keys']:,} keys loaded in {shared['fill_s']:.1f} s, "
          f"tier start-up (SCAN) {shared['start_up_s']:.1f} s; another engine wrote "
          f"{shared['writer_rate']:.0f} keys/s during the steady steps (--writer-rate); tier "
          f"counts { {k: v for k, v in counts.items() if v} }")
    print(f"  delay until another engine's write is found (--delay-keys): {shared['delay']}")


def _block(key: bytes, block_bytes: int) -> torch.Tensor:
    seed = int.from_bytes(key[:8], "little")
    return torch.randint(0, 256, (block_bytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def _wait(tier: ValkeyTier, job: int) -> bool:
    """Whether job ``job`` wrote every key."""
    while True:
        for result in tier.poll():
            if result.job_id == job:
                return all(result.succeeded)
        time.sleep(0.001)


def _pipe_filler(server: LocalServer, names: list[bytes]) -> None:
    """SET each name to a 1-byte value, through ``redis-cli --pipe`` (the fastest load)."""
    proc = subprocess.Popen([cli_binary(), "-p", str(server.port), "--pipe"],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    batch = []
    for name in names:
        batch.append(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$1\r\nx\r\n" % (len(name), name))
        if len(batch) >= 10_000:
            proc.stdin.write(b"".join(batch))
            batch = []
    proc.stdin.write(b"".join(batch))
    proc.stdin.close()
    if proc.wait(600) != 0:
        raise RuntimeError("redis-cli --pipe failed")


def _writer(url: str, block_bytes: int, rate: float, count: int, log: str | None) -> None:
    """Another engine: writes random new blocks at ``rate`` per second (``count``: how many,
    0 = until SIGTERM), appending {"key", "t"} lines to ``log`` once each write landed."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    tier = ValkeyTier.from_options(_options(url, refresh_interval_s=0, **QUIET), FINGERPRINT)
    rng = random.Random(os.getpid())
    out = open(log, "a") if log else None  # noqa: SIM115 (closed below)
    n, start = 0, time.monotonic()
    while not stop.is_set() and (count == 0 or n < count):
        key = rng.randbytes(32)
        written = _wait(tier, tier.submit_write([key], [_block(key, block_bytes)]))
        if out is not None and written:  # (a write that failed is no key to find)
            out.write(json.dumps({"key": key.hex(), "t": time.time()}) + "\n")
            out.flush()
        n += 1
        time.sleep(max(0.0, start + n / rate - time.monotonic()))
    if out is not None:
        out.close()
    tier.close()


if __name__ == "__main__":
    if sys.argv[1] == "writer":
        _writer(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]),
                sys.argv[6] if len(sys.argv) > 6 else None)
