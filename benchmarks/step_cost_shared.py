"""The step-cost benchmark over a real shared store: `--tier valkey` and `--tier s3` (issue 25).

Instead of the synthetic index, the worker's storage tier is a real `ValkeyTier` on a real
`redis-server` on loopback, or a real `S3Tier` on a moto S3 server on loopback
(`step_cost_s3.py`), that already holds the benchmark's inventory (1,000,000 keys by
default), so whatever the tier does in the engine's process while the engine steps — the
start-up SCAN or listing and its inventory streaming to the scheduler, the keyspace
notifications of other engines' writes, the paced SCAN or listing crawl — is in the
measured step times.

- The inventory: the documents' blocks are real records (they are loaded by the requests
  that read documents); the other keys are filler with a 1-byte value (never read: the
  requests never ask for them). Valkey: loaded with ``redis-cli --pipe``; S3: put straight
  into the moto server's backend before it serves (`s3_bucket_server.py`).
- While the engine steps, another process (``writer``: another engine, a `BlockWriter`)
  writes new blocks at ``--writer-rate`` keys per second: the Valkey tier under test hears
  of each one by its keyspace notification, the S3 tier when its crawl passes the name.
- ``--helpers-niced``: the server and the writer processes run at nice 19 (every thread),
  so they get only the CPU the engine's process leaves. On a fleet they are other machines;
  on this benchmark's two cores they otherwise take cores from the engine's thread in the
  very steps being timed. Runs with and without it tell the store's own cost in our
  process from the co-located server's.
- After the steps, the delay until other engines' writes are found: a writer process writes
  ``--delay-keys`` keys, noting when each write returned, while this process polls
  `lookup` every 2 ms (the engine is stopped then: the probe measures the tier, not a
  busy interpreter), for at most the run's ``delay_bound_s``.

    python benchmarks/bench_step_cost.py --tier valkey --skip-prefill --json step-cost-valkey.json
    python benchmarks/bench_step_cost.py --tier s3 --skip-prefill --json step-cost-s3.json
"""

from __future__ import annotations

import contextlib
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


class BlockWriter:
    """Another engine's writes, in the ``writer`` process: one block at a time."""

    def write(self, key: bytes, block: torch.Tensor) -> bool:
        """Store one block; whether it landed."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class ValkeyWriter(BlockWriter):
    """Writes through its own `ValkeyTier` (no notifications, no refresh)."""

    def __init__(self, url: str) -> None:
        self._tier = ValkeyTier.from_options(_options(url, refresh_interval_s=0, **QUIET),
                                             FINGERPRINT)

    def write(self, key: bytes, block: torch.Tensor) -> bool:
        return _wait(self._tier, self._tier.submit_write([key], [block]))

    def close(self) -> None:
        self._tier.close()


def open_writer(kind: str, where: str) -> BlockWriter:
    if kind == "s3":
        from step_cost_s3 import S3Writer  # (it imports this module)

        return S3Writer(where)
    return ValkeyWriter(where)


@dataclass
class SharedTierRun:
    """A server holding the inventory, the tier under test on it, and a writer process.

    ``where``: what a writer process needs to reach the store (a URL); ``delay_bound_s``:
    how long the delay probe waits for the last write to be found; ``server_notes``: what
    the server's start-up measured (printed and put in the JSON)."""

    kind: str
    server: object  # (has stop())
    where: str
    tier: object  # the StorageTier under test
    block_bytes: int
    start_up_s: float
    fill_s: float
    delay_bound_s: float = 120.0
    server_notes: dict = field(default_factory=dict)
    writer: subprocess.Popen | None = None
    niced: bool = False  # --helpers-niced: the server and writers at nice 19
    delays_s: list[float] = field(default_factory=list)
    final_counts: dict = field(default_factory=dict)

    def inventory_left(self) -> int:
        return 0  # (the start-up SCAN or listing put the whole inventory in the view)

    def counts(self) -> dict:
        return dict(self.tier.stats().counts)

    def _writer_command(self, rate: float, count: int, log: str | None = None) -> list[str]:
        return [sys.executable, __file__, "writer", self.kind, self.where,
                str(self.block_bytes), str(rate), str(count), *([log] if log else [])]

    def _spawn(self, command: list[str]) -> subprocess.Popen:
        # (coreutils' nice, not a preexec_fn: that is unsafe in a process with threads)
        return subprocess.Popen(["nice", "-n", "19", *command] if self.niced else command)

    def nice_helpers(self) -> None:
        """The server at nice 19 now (every thread), and every writer started from here."""
        lower_priority(self.server.process.pid)
        self.niced = True

    def start_writer(self, rate: float) -> None:
        if rate > 0:
            self.writer = self._spawn(self._writer_command(rate, 0))

    def stop_writer(self) -> None:
        if self.writer is not None:
            self.writer.send_signal(signal.SIGTERM)
            self.writer.wait(30)
            self.writer = None

    def _drain_writes(self, quiet_s: float = 2.0, at_most_s: float = 600.0) -> float:
        """Wait until the engine's own stores stop landing (its writes counters still for
        ``quiet_s``); returns the seconds waited. A store that serves requests one at a time
        (moto) answers a listing page only between the PUTs of that backlog: without this,
        the probe would time the backlog, not the crawl."""
        def written() -> int:
            return sum(n for name, n in self.counts().items() if name.startswith("write"))
        started = last_change = time.monotonic()
        last = written()
        while time.monotonic() - last_change < quiet_s and \
                time.monotonic() - started < at_most_s:
            time.sleep(0.2)
            if (now := written()) != last:
                last, last_change = now, time.monotonic()
        return last_change - started

    def measure_delay(self, keys: int) -> dict:
        """Another engine writes ``keys`` keys; how long until `lookup` finds each (once
        the engine's own stores have landed: `_drain_writes`)."""
        drained_s = self._drain_writes()
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "written.jsonl"
            proc = self._spawn(self._writer_command(50, keys, str(log)))
            seen: dict[str, float] = {}
            written: dict[str, float] = {}
            deadline = time.time() + self.delay_bound_s
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
        return {"keys": len(written), "not_found": missing, "stores_drained_s": drained_s,
                "waited_at_most_s": self.delay_bound_s,
                "delays_s": [round(d, 3) for d in self.delays_s],
                "p50_ms": pick(0.5) * 1e3, "p99_ms": pick(0.99) * 1e3,
                "max_ms": self.delays_s[-1] * 1e3} if self.delays_s else {"keys": 0}

    def close(self) -> None:
        self.final_counts = self.counts()
        self.stop_writer()
        self.tier.close()
        self.server.stop()


def start_shared(kind: str, inventory: list[bytes], documents: set[bytes], block_bytes: int,
                 args) -> SharedTierRun:
    """The store ``kind`` holding ``inventory`` and the tier under test on it."""
    if kind == "s3":
        from step_cost_s3 import start_s3

        run = start_s3(inventory, documents, block_bytes,
                       pages_per_refresh=getattr(args, "s3_pages_per_refresh", 1))
    else:
        run = start_valkey(inventory, documents, block_bytes)
    if getattr(args, "helpers_niced", False):
        run.nice_helpers()
    return run


def lower_priority(pid: int) -> None:
    """Every thread of process ``pid`` to nice 19 (on Linux a nice value is per thread: the
    server's threads started before this keep theirs otherwise)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # (a thread that just ended)
            os.setpriority(os.PRIO_PROCESS, int(tid), 19)


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
        job = loader.submit_write(chunk, [block_of(k, block_bytes) for k in chunk])
        _wait(loader, job)
    loader.close()
    fill_s = time.monotonic() - started
    started = time.monotonic()
    tier = ValkeyTier.from_options(_options(server.url), FINGERPRINT)
    return SharedTierRun("valkey", server, server.url, tier, block_bytes,
                         time.monotonic() - started, fill_s)


def print_shared(steps: dict) -> None:
    """The shared-store lines of the benchmark's per-step table."""
    shared, counts = steps["shared"], steps["tier"]
    print(f"  {shared['kind']}: {steps['keys']:,} keys loaded in {shared['fill_s']:.1f} s, "
          f"tier start-up (whole SCAN / listing) {shared['start_up_s']:.1f} s "
          f"{shared.get('server') or ''}; another engine wrote "
          f"{shared['writer_rate']:.0f} keys/s during the steady steps (--writer-rate"
          f"{'; server and writers at nice 19' if shared.get('helpers_niced') else ''}); tier "
          f"counts { {k: v for k, v in counts.items() if v} }")
    delay = {k: v for k, v in (shared["delay"] or {}).items() if k != "delays_s"}
    print(f"  delay until another engine's write is found (--delay-keys): "
          f"{delay or 'not measured (--delay-keys 0)'}")


def block_of(key: bytes, block_bytes: int) -> torch.Tensor:
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


def _writer(kind: str, where: str, block_bytes: int, rate: float, count: int,
            log: str | None) -> None:
    """Another engine: writes random new blocks at ``rate`` per second (``count``: how many,
    0 = until SIGTERM), appending {"key", "t"} lines to ``log`` once each write landed."""
    try:  # (the tree under test's key shape; not via step_cost_compat: it imports vLLM)
        from kv_offload.store.key_view import storage_key
    except ImportError:  # an older tree (--before): before the layout, or before key_view
        try:
            from kv_offload.key_view import storage_key
        except ImportError:
            from kv_offload.tiering import storage_key

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    writer = open_writer(kind, where)
    rng = random.Random(os.getpid())
    out = open(log, "a") if log else None  # noqa: SIM115 (closed below)
    n, start = 0, time.monotonic()
    parent = os.getppid()  # (a bench killed without cleanup: this writer ends with it)
    while not stop.is_set() and (count == 0 or n < count) and os.getppid() == parent:
        # Shaped like the engine's storage keys (a common header, then the block hash): an
        # S3 crawl finds a name when it passes it, so where new names sort matters.
        key = storage_key((rng.randbytes(32), 0))
        written = writer.write(key, block_of(key, block_bytes))
        if out is not None and written:  # (a write that failed is no key to find)
            out.write(json.dumps({"key": key.hex(), "t": time.time()}) + "\n")
            out.flush()
        n += 1
        time.sleep(max(0.0, start + n / rate - time.monotonic()))
    if out is not None:
        out.close()
    writer.close()


if __name__ == "__main__":
    if sys.argv[1] == "writer":
        _writer(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]),
                int(sys.argv[6]), sys.argv[7] if len(sys.argv) > 7 else None)
