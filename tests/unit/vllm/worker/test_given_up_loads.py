"""The worker gives an in-step load up at its bound (a slow disk): vLLM is told its blocks
failed and recomputes them, and nothing of that load reaches them afterwards, when the
disk answers at last. Real worker, real disk tier and threads; the disk's results are held
back until the test lets them through."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from kv_offload.config import OffloadConfig  # noqa: E402
from kv_offload.vllm.worker.offload_worker import OffloadWorker  # noqa: E402

from unit.store.host.test_cpu_backend_stalled_copies import in_thread, returned  # noqa: E402
from unit.vllm.worker.test_worker_side import (  # noqa: E402
    NUM_BLOCKS,
    ON_DISK,
    Engine,
    block_hash,
    make_worker,
    poll_until,
    report,
    store,
    wait_for_changes,
)

BOUND_S = 0.3  # the worker's copy bound under test


def worker_over_a_slow_disk(engine, tmp_path, workers, monkeypatch, hashes):
    """A worker whose disk holds `hashes` (blocks 1.. of `engine`, written by an earlier
    one) and whose disk results are held back until the returned event is set."""
    first = make_worker(engine, tmp_path)
    workers.append(first)
    store(first, {0: (hashes, list(range(1, 1 + len(hashes))))})
    first.shutdown()  # on disk now
    worker = OffloadWorker(OffloadConfig(cpu_bytes_to_use=1 << 20,
                                         storage_tier="filesystem",
                                         storage_options={"root_dir": str(tmp_path / "kv"),
                                                          "bytes_to_use": 64 << 20},
                                         in_step_read_s=0,
                                         copy_timeout_s=BOUND_S), 0, "test-model")
    worker.register(engine.caches, engine.groups, NUM_BLOCKS)
    workers.append(worker)
    wait_for_changes(worker, {(h, 0): ON_DISK for h in hashes})
    flowing = threading.Event()  # set: the disk's results reach the store
    poll = worker.store.storage.poll
    monkeypatch.setattr(worker.store.storage, "poll",
                        lambda: poll() if flowing.is_set() else [])
    return worker, flowing


def given_up_in_step_load(engine, tmp_path, workers, monkeypatch, tag: bytes, step: int = 0):
    """A worker whose in-step load of "r" into blocks 5 and 6 waits for the slow disk and
    is given up at the bound (its blocks reported failed); the disk's answers held back."""
    hashes = [block_hash(i, tag) for i in range(2)]
    worker, flowing = worker_over_a_slow_disk(engine, tmp_path, workers, monkeypatch, hashes)
    worker.begin_step(step)
    worker.start_loads({"r": {0: (hashes, [5, 6])}}, in_step={"r"})  # (back at the bound)
    assert worker.take_block_errors() == {5, 6}, "the late blocks were not reported"
    return worker, flowing


def unchanged(engine, blocks, before) -> list[bool]:
    return [all(torch.equal(x, y) for x, y in zip(engine.block_bytes(0, b), r))
            for b, r in zip(blocks, before)]


def test_an_in_step_load_past_its_bound_is_recomputed_and_never_written_later(
        workers, tmp_path, monkeypatch):
    engine = Engine()
    worker, flowing = given_up_in_step_load(engine, tmp_path, workers, monkeypatch, b"late")
    # Until that load ends, the scheduler is told: no new in-step load waits on it.
    assert report(worker).copies_stalled
    engine.zero(0, [5, 6])  # vLLM's recompute of those blocks (stand-in bytes)
    recomputed = [engine.block_bytes(0, b) for b in (5, 6)]
    flowing.set()
    poll_until(lambda: not report(worker).copies_stalled,
               lambda: "the given-up load never ended")
    worker.shutdown()  # waits for every job
    workers.remove(worker)
    assert unchanged(engine, (5, 6), recomputed) == [True, True], \
        "a load given up on wrote its blocks after vLLM recomputed them"


def test_a_held_request_is_reported_back_only_once_its_given_up_load_ended(
        workers, tmp_path, monkeypatch):
    worker, flowing = given_up_in_step_load(Engine(), tmp_path, workers, monkeypatch, b"held",
                                            step=7)
    first = report(worker)
    assert (first.stalled, first.step) == (("r",), 7)
    # vLLM ended "r" and "done" (whose load ended long ago) and keeps their blocks:
    worker.hold_for_copies(["r", "done"])
    assert worker.finished_loads() == ({"done"}, set())  # "done" back at once, "r" not
    assert worker.finished_loads() == (set(), set())
    flowing.set()  # the disk answers: the given-up load ends
    back: set[str] = set()
    poll_until(lambda: back.update(worker.finished_loads()[0]) or back,
               lambda: "the held request was never reported back")
    assert back == {"r"} and not report(worker).stalled


def test_a_forward_reusing_a_given_up_loads_blocks_waits_until_that_load_ended(
        workers, tmp_path, monkeypatch):
    worker, flowing = given_up_in_step_load(Engine(), tmp_path, workers, monkeypatch,
                                            b"reused")
    # vLLM preempted "r" and hands block 5 to another request in this step:
    out = in_thread(worker.wait_for_given_up_loads)
    assert not returned(out, patience_s=4 * BOUND_S), "the forward went on past the bound"
    flowing.set()  # the disk answers: the given-up load ends
    assert returned(out), "the wait did not end with the given-up load"
    assert not report(worker).stalled


def test_sleep_gives_up_loads_still_reading_so_nothing_writes_unmapped_memory(
        workers, tmp_path, monkeypatch):
    engine = Engine()
    hashes = [block_hash(i, b"asleep") for i in range(2)]
    worker, flowing = worker_over_a_slow_disk(engine, tmp_path, workers, monkeypatch, hashes)
    worker.start_loads({"r": {0: (hashes, [5, 6])}})  # asynchronous: waits for the disk
    before = [engine.block_bytes(0, b) for b in (5, 6)]
    worker.suspend()  # vLLM unmaps engine memory next: gives the load up at the bound
    flowing.set()
    worker.shutdown()  # the read lands meanwhile
    workers.remove(worker)
    assert unchanged(engine, (5, 6), before) == [True, True], \
        "a load went on writing engine memory after sleep gave it up"
    finished, failed = worker.finished_loads()
    assert finished == failed == {"r"}  # (reported failed: vLLM recomputes it)
