"""OffloadWorker (the connector's worker side) on real CPU tensors laid out like vLLM 0.32's
CPU backend (LBHNC views into one int8 buffer), with the real host and disk tiers."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from kv_offload.config import OffloadConfig  # noqa: E402
from kv_offload.specs import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec  # noqa: E402
from kv_offload.store.key_view import storage_key  # noqa: E402
from kv_offload.testing.engine_alloc import allocate_kv_caches  # noqa: E402
from kv_offload.types import Location  # noqa: E402
from kv_offload.vllm.worker.offload_worker import OffloadWorker  # noqa: E402

NUM_BLOCKS = 32
ATTN = dict(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
FULL = FullAttentionSpec(**ATTN)
GROUPS = [KVCacheGroup(["layers.0.attn", "layers.1.attn"], FULL)]
BYTES_PER_BLOCK = 2 * FULL.page_size_bytes  # two layers
WAIT_S = 10.0
ABSENT, IN_HOST, ON_DISK = Location.ABSENT, Location.HOST, Location.STORAGE


class Engine:
    """kv_caches as vLLM's CPU backend hands them over, filled with random bytes."""

    def __init__(self, groups=GROUPS, seed: int = 0) -> None:
        self.groups = groups
        self.buffer, self.caches = allocate_kv_caches(groups, NUM_BLOCKS, "LBHNC")
        generator = torch.Generator().manual_seed(seed)
        self.buffer.copy_(torch.randint(-128, 128, self.buffer.shape, dtype=torch.int8,
                                        generator=generator))

    def block_bytes(self, group: int, block_id: int) -> list[torch.Tensor]:
        return [self.caches[name][block_id].view(torch.uint8).clone()
                for name in self.groups[group].layer_names]

    def zero(self, group: int, block_ids) -> None:
        for name in self.groups[group].layer_names:
            self.caches[name][list(block_ids)] = 0


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def block_hash(i: int, salt: bytes = b"") -> bytes:
    return hashlib.sha256(salt + i.to_bytes(4, "little")).digest()  # 32 bytes, like vLLM's


def make_worker(engine: Engine, tmp_path: Path | None = None, rank: int = 0,
                **options) -> OffloadWorker:
    disk = {} if tmp_path is None else dict(storage_tier="filesystem",
                                            storage_options={"root_dir": str(tmp_path / "kv"),
                                                             "bytes_to_use": 64 << 20})
    worker = OffloadWorker(OffloadConfig(cpu_bytes_to_use=1 << 20, **disk, **options), rank,
                           "test-model")
    worker.register(engine.caches, engine.groups, NUM_BLOCKS)
    return worker


def store(worker: OffloadWorker, stores) -> None:
    worker.start_stores(stores)
    worker.wait_for_engine_copies(timeout_s=WAIT_S)


def poll_until(done, what: str, between=lambda: time.sleep(0.002)) -> None:
    """Call `between()` until `done()` holds, for at most WAIT_S (then fail: `what()`)."""
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, what()
        between()


def wait_loads(worker: OffloadWorker, request_ids: set[str]) -> tuple[set[str], set[str]]:
    """Poll `finished_loads` like vLLM does each step, until these requests finished."""
    finished, failed = set(), set()

    def done() -> bool:
        ended, bad = worker.finished_loads()
        finished.update(ended)
        failed.update(bad)
        return request_ids <= finished

    poll_until(done, lambda: f"loads {request_ids - finished} did not finish")
    return finished, failed


def report(worker: OffloadWorker):
    meta = worker.report()
    assert list(meta.reports) == [worker.rank]
    return meta.reports[worker.rank]


def changes(worker: OffloadWorker) -> dict:
    """key -> its new location, for the keys this rank reports changed."""
    return {change.key: change.location for change in report(worker).changes}


def wait_for_changes(worker: OffloadWorker, expected: dict) -> dict:
    """Reports until these changes were all seen (the storage tier's feed is polled by
    the pump, a few ms behind); returns everything reported meanwhile."""
    seen: dict = {}
    poll_until(lambda: seen.update(changes(worker)) or
               all(seen.get(k) == v for k, v in expected.items()),
               lambda: f"never reported: {expected} (saw {seen})")
    return seen


def test_stores_are_reported_once_and_load_back_byte_identical(workers):
    engine = Engine()
    worker = make_worker(engine)
    workers.append(worker)
    hashes = [block_hash(i) for i in range(4)]
    originals = [engine.block_bytes(0, b) for b in (1, 2, 3, 4)]
    assert changes(worker) == {}  # first report: nothing held yet
    store(worker, {0: (hashes, [1, 2, 3, 4])})
    assert changes(worker) == {(h, 0): IN_HOST for h in hashes}
    assert changes(worker) == {}  # exactly once

    engine.zero(0, range(NUM_BLOCKS))
    worker.start_loads({"r1": {0: (hashes[1:], [10, 11, 12])}})
    finished, failed = wait_loads(worker, {"r1"})
    assert finished == {"r1"} and failed == set()
    for b, original in zip((10, 11, 12), originals[1:]):
        assert same_bytes(engine.block_bytes(0, b), original)
    zero = [torch.zeros_like(t) for t in originals[0]]
    assert same_bytes(engine.block_bytes(0, 13), zero)  # nothing else was written
    assert same_bytes(engine.block_bytes(0, 1), zero)


def test_loading_a_key_nobody_stored_fails_that_request_only(workers):
    engine = Engine()
    worker = make_worker(engine)
    workers.append(worker)
    store(worker, {0: ([block_hash(0)], [1])})
    original = engine.block_bytes(0, 1)
    worker.start_loads({"r1": {0: ([block_hash(0), block_hash(99)], [5, 6])},
                        "r2": {0: ([block_hash(0)], [7])}})
    finished, failed = wait_loads(worker, {"r1", "r2"})
    assert finished == {"r1", "r2"} and failed == {"r1"}
    assert same_bytes(engine.block_bytes(0, 7), original)


def test_same_hash_in_two_groups_is_two_keys(workers):
    window = SlidingWindowSpec(sliding_window=32, **ATTN)
    groups = [KVCacheGroup(["layers.0.attn", "layers.2.attn"], window),
              KVCacheGroup(["layers.1.attn", "layers.3.attn"], FULL)]  # they overlay in memory
    engine = Engine(groups, seed=1)
    worker = make_worker(engine)
    workers.append(worker)
    h = block_hash(7)
    swa, full = engine.block_bytes(0, 3), engine.block_bytes(1, 4)
    assert not same_bytes(swa, full)
    store(worker, {0: ([h], [3]), 1: ([h], [4])})
    assert changes(worker) == {(h, 0): IN_HOST, (h, 1): IN_HOST}
    worker.start_loads({"r": {0: ([h], [8]), 1: ([h], [9])}})
    assert wait_loads(worker, {"r"})[1] == set()
    assert same_bytes(engine.block_bytes(0, 8), swa)
    assert same_bytes(engine.block_bytes(1, 9), full)


def test_a_reset_is_reported_as_one_flag_not_a_removal_per_key(workers):
    engine = Engine()
    worker = make_worker(engine)
    workers.append(worker)
    hashes = [block_hash(i) for i in range(3)]
    store(worker, {0: (hashes, [1, 2, 3])})
    changes(worker)
    worker.reset()
    after = report(worker)
    assert after.reset and after.changes == ()
    assert not report(worker).reset  # once
    worker.start_loads({"r": {0: (hashes[:1], [5])}})
    assert wait_loads(worker, {"r"})[1] == {"r"}


def test_stats_count_loads_stores_and_bytes(workers):
    engine = Engine()
    worker = make_worker(engine)
    workers.append(worker)
    hashes = [block_hash(i) for i in range(4)]
    store(worker, {0: (hashes, [1, 2, 3, 4])})
    worker.start_loads({"ok": {0: (hashes[:3], [10, 11, 12])},
                        "bad": {0: ([block_hash(50)], [13])}})
    wait_loads(worker, {"ok", "bad"})
    stats = worker.take_stats()
    assert stats.count("store_jobs") == 1
    assert stats.count("store_blocks") == 4
    assert stats.count("store_bytes") == 4 * BYTES_PER_BLOCK
    assert stats.count("load_jobs") == 2
    assert stats.count("load_blocks") == 4
    assert stats.count("load_bytes") == 4 * BYTES_PER_BLOCK
    assert stats.count("load_failed_blocks") == 1
    assert stats.count("load_failed_jobs") == 1
    assert stats.usage("bytes_used", "host") == 4 * BYTES_PER_BLOCK
    assert stats.usage("bytes_total", "host") >= 4 * BYTES_PER_BLOCK
    later = worker.take_stats()  # counters restart for the next interval
    assert later is None or later.count("store_jobs") == later.count("load_jobs") == 0


def test_disk_tier_survives_a_restart_and_drops_a_corrupt_file(workers, tmp_path):
    engine = Engine()
    first = make_worker(engine, tmp_path)
    workers.append(first)
    hashes = [block_hash(i, b"disk") for i in range(4)]
    originals = [engine.block_bytes(0, b) for b in (1, 2, 3, 4)]
    store(first, {0: (hashes, [1, 2, 3, 4])})
    assert set(changes(first).values()) == {IN_HOST}
    first.shutdown()  # finishes the write-through to disk

    engine.zero(0, range(NUM_BLOCKS))
    # A new process over the same directory. No read probe (in_step_read_s=0): the probe
    # reads keys from disk at start-up, and one it reads before the corruption below
    # would (rightly) serve the bytes it verified; tests/unit/store/test_tiering_probe.py covers
    # a probe that meets a corrupt file.
    second = make_worker(engine, tmp_path, in_step_read_s=0)
    workers.append(second)
    assert wait_for_changes(second, {(h, 0): ON_DISK for h in hashes}) == {
        (h, 0): ON_DISK for h in hashes}
    assert changes(second) == {}

    name = storage_key((hashes[3], 0), second.store.generation).hex()  # (the store's own)
    files = list((tmp_path / "kv").rglob(name + ".safetensors"))
    assert len(files) == 1
    data = bytearray(files[0].read_bytes())
    data[-100] ^= 0xFF  # inside the page data, after the header
    files[0].write_bytes(bytes(data))

    second.start_loads({"good": {0: (hashes[:3], [5, 6, 7])},
                        "bad": {0: (hashes[3:], [8])}})
    finished, failed = wait_loads(second, {"good", "bad"})
    assert finished == {"good", "bad"} and failed == {"bad"}
    for b, original in zip((5, 6, 7), originals):
        assert same_bytes(engine.block_bytes(0, b), original)
    # Read back into host memory; the corrupt key is gone from every tier.
    expected = {**{(h, 0): IN_HOST for h in hashes[:3]}, (hashes[3], 0): ABSENT}
    assert wait_for_changes(second, expected) == expected
    assert not files[0].exists()


def small_host_worker(engine: Engine, slots: int) -> OffloadWorker:
    worker = OffloadWorker(OffloadConfig(cpu_bytes_to_use=slots * BYTES_PER_BLOCK), 0, "m")
    worker.register(engine.caches, engine.groups, NUM_BLOCKS)
    return worker


def test_host_eviction_is_reported(workers):
    engine = Engine()
    worker = small_host_worker(engine, slots=2)
    workers.append(worker)
    old, new = [block_hash(0), block_hash(1)], [block_hash(2), block_hash(3)]
    store(worker, {0: (old, [1, 2])})
    assert changes(worker) == {(h, 0): IN_HOST for h in old}
    store(worker, {0: (new, [3, 4])})  # evicts both older keys (LRU)
    assert changes(worker) == {**{(h, 0): ABSENT for h in old},
                               **{(h, 0): IN_HOST for h in new}}
    worker.start_loads({"evicted": {0: (old[:1], [9])}, "kept": {0: (new, [10, 11])}})
    assert wait_loads(worker, {"evicted", "kept"})[1] == {"evicted"}


def test_a_store_larger_than_the_room_stores_its_leading_blocks_and_skips_the_rest(workers):
    engine = Engine()
    worker = small_host_worker(engine, slots=2)
    workers.append(worker)
    hashes = [block_hash(i) for i in range(3)]
    store(worker, {0: (hashes, [1, 2, 3])})  # 3 blocks, 2 slots
    assert changes(worker) == {(h, 0): IN_HOST for h in hashes[:2]}
    worker.finished_loads()
    stats = worker.take_stats()
    assert stats.count("store_blocks") == 2
    assert stats.count("store_skipped_blocks") == 1
    assert stats.count("store_failed_blocks") == 0


def test_reset_serves_nothing_stored_before_it_keeps_files_and_survives_a_read(workers,
                                                                             tmp_path):
    """vLLM resets the connector after new weights: nothing stored before may be served
    after, from host memory or disk. The reset does not wait and deletes no file (other
    engines sharing the directory may be reading them): a new key generation starts. A load
    reading from disk at that moment ends normally or fails (recomputed); the worker keeps
    working."""
    engine = Engine()
    first = make_worker(engine, tmp_path)
    workers.append(first)
    hashes = [block_hash(i, b"reset") for i in range(3)]
    store(first, {0: (hashes, [1, 2, 3])})
    first.shutdown()
    worker = make_worker(engine, tmp_path)  # disk only: loads read files into host slots
    workers.append(worker)
    wait_for_changes(worker, {(h, 0): ON_DISK for h in hashes})

    worker.start_loads({"r": {0: (hashes, [4, 5, 6])}})
    worker.reset()  # while the files are being read, or right after
    wait_loads(worker, {"r"})
    assert worker._pump.is_alive()
    assert len(list((tmp_path / "kv").rglob("*.safetensors"))) == 3  # nothing deleted
    assert report(worker).reset
    worker.start_loads({"old": {0: (hashes, [4, 5, 6])}})
    assert wait_loads(worker, {"old"}) == ({"old"}, {"old"})  # never served after the reset
    # Still serving: a new store and load round-trip.
    store(worker, {0: ([block_hash(9, b"reset")], [7])})
    worker.start_loads({"s": {0: ([block_hash(9, b"reset")], [8])}})
    assert wait_loads(worker, {"s"}) == ({"s"}, set())
    assert same_bytes(engine.block_bytes(0, 8), engine.block_bytes(0, 7))


def test_a_store_whose_copy_never_ends_is_abandoned_at_the_timeout_and_never_served(workers):
    engine = Engine()
    worker = make_worker(engine)
    workers.append(worker)
    hashes = [block_hash(i, b"stuck") for i in range(3)]
    host = worker.store.cpu
    poll = host.poll
    with worker._lock:  # the host tier's copies finish, but their results never come back
        host.poll = list
    worker.start_stores({0: (hashes, [1, 2, 3])})
    started = time.monotonic()
    worker.wait_for_engine_copies(timeout_s=0.3)  # returns: the engine goes on
    assert 0.3 <= time.monotonic() - started < WAIT_S
    with worker._lock:
        host.poll = poll
    deadline = time.monotonic() + WAIT_S
    while worker.store.manager.num_free_slots < worker.store.cpu.num_slots:
        assert time.monotonic() < deadline, "the abandoned store never released its slots"
        time.sleep(0.01)
    assert changes(worker) == {}  # never reported as held
    worker.start_loads({"r": {0: (hashes, [10, 11, 12])}})
    assert wait_loads(worker, {"r"}) == ({"r"}, {"r"})  # never served


def idle_steps(worker: OffloadWorker, until, first_loads=None) -> None:
    """Step like vLLM's engine while nothing runs a forward (its only request waits for
    our load): `start_load_kv`, then at once `wait_for_save`, then the results — one step
    per millisecond, until `until()` holds."""
    loads, steps = [first_loads or {}], [0]

    def step() -> None:
        worker.start_loads(loads.pop() if loads else {})
        worker.start_stores({})
        steps[0] += 1
        time.sleep(0.001)

    poll_until(until, lambda: f"not done after {steps[0]} engine steps", step)


def test_stores_and_loads_finish_while_the_engine_steps_without_a_forward(workers):
    engine = Engine()
    worker = make_worker(engine)
    workers.append(worker)
    hashes = [block_hash(i) for i in range(3)]
    originals = [engine.block_bytes(0, b) for b in (1, 2, 3)]
    worker.start_stores({0: (hashes, [1, 2, 3])})
    # The store is copied out and reported while the engine only steps.
    seen: dict = {}
    idle_steps(worker, lambda: seen.update(changes(worker)) or
               seen == {(h, 0): IN_HOST for h in hashes})
    engine.zero(0, range(NUM_BLOCKS))
    finished: set[str] = set()
    idle_steps(worker, lambda: finished.update(worker.finished_loads()[0]) or "r1" in finished,
               first_loads={"r1": {0: (hashes, [10, 11, 12])}})
    for b, original in zip((10, 11, 12), originals):
        assert same_bytes(engine.block_bytes(0, b), original)


EXITING_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from unit.vllm.worker.test_worker_side import Engine, block_hash, make_worker
from pathlib import Path
worker = make_worker(Engine(), Path({tmp!r}))
worker.start_stores({{0: ([block_hash(i) for i in range(6)], [1, 2, 3, 4, 5, 6])}})
# the script ends here, as an offline `LLM` script may right after its last step: the
# store is not even copied out yet, and nothing is shut down
"""


def test_a_process_that_exits_right_after_a_store_leaves_it_in_the_storage_tier(tmp_path):
    import subprocess
    import sys

    script = EXITING_SCRIPT.format(tests=str(Path(__file__).parents[3]), tmp=str(tmp_path))
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    files = list((tmp_path / "kv").rglob("*.safetensors"))
    assert len(files) == 6, f"write-through lost at exit: {len(files)} of 6 files"
