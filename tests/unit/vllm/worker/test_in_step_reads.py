"""Hits read from the storage tier inside the step: each rank measures its storage read
throughput on its own reads and reports it (the scheduler side decides from it, see
test_vllm_in_step_loads.py); an in-step load that reads from disk is complete, its bytes in
engine memory, when `start_loads` returns. Real files, real threads."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from kv_offload.config import parse_config  # noqa: E402
from kv_offload.errors import ConfigError  # noqa: E402
from kv_offload.types import Location  # noqa: E402
from kv_offload.vllm.worker.offload_worker import IDLE_WAIT_S  # noqa: E402

from unit.vllm.worker.test_worker_side import (  # noqa: E402
    ON_DISK,
    Engine,
    block_hash,
    make_worker,
    poll_until,
    same_bytes,
    store,
    wait_for_changes,
    wait_loads,
)


def _on_disk_only(workers, tmp_path, salt: bytes, **options):
    """A rank whose disk holds 4 blocks another process stored; the engine forgot them."""
    engine = Engine()
    first = make_worker(engine, tmp_path)
    workers.append(first)
    hashes = [block_hash(i, salt) for i in range(4)]
    originals = [engine.block_bytes(0, b) for b in (1, 2, 3, 4)]
    store(first, {0: (hashes, [1, 2, 3, 4])})
    first.shutdown()  # finishes the write-through to disk
    engine.zero(0, range(1, 12))
    second = make_worker(engine, tmp_path, **options)  # a new process, the same directory
    workers.append(second)
    wait_for_changes(second, {(h, 0): ON_DISK for h in hashes})
    return engine, second, hashes, originals


def test_a_rank_measures_its_read_rate_before_its_first_load_and_reports_it(workers,
                                                                            tmp_path):
    # A new process over a full directory: its storage tier is measured by a probe read
    # (kv_offload.store.probe), so the first hit can already load in-step.
    _, worker, hashes, _ = _on_disk_only(workers, tmp_path, b"rate")
    poll_until(lambda: worker.report().reports[0].read_bytes_per_s > 0,
               lambda: "the rank never measured its storage tier")
    rate = worker.report().reports[0].read_bytes_per_s
    assert 0 < rate < 1e12  # bytes per second, from the read's bytes over its wall time
    with worker._lock:  # the probe moved nothing: every block still only on disk
        assert worker.store.lookup([(h, 0) for h in hashes]) == [Location.STORAGE] * 4


def test_without_storage_reads_in_step_there_is_no_probe_and_a_load_measures(workers,
                                                                            tmp_path):
    _, worker, hashes, _ = _on_disk_only(workers, tmp_path, b"rate-off", in_step_read_s=0)
    time.sleep(1.5)  # (the pump's polls: a probe would have read by now)
    assert worker.report().reports[0].read_bytes_per_s == 0.0  # nothing read: no figure
    worker.start_loads({"r": {0: (hashes, [5, 6, 7, 8])}})
    assert wait_loads(worker, {"r"}) == ({"r"}, set())
    assert worker.report().reports[0].read_bytes_per_s > 0


def test_an_in_step_load_from_disk_is_in_engine_memory_when_start_loads_returns(workers,
                                                                                tmp_path):
    engine, worker, hashes, originals = _on_disk_only(workers, tmp_path, b"in-step")
    worker.start_loads({"r": {0: (hashes, [5, 6, 7, 8])}}, in_step=["r"])
    for block, original in zip((5, 6, 7, 8), originals):
        assert same_bytes(engine.block_bytes(0, block), original)
    assert worker.take_block_errors() == set()
    assert worker.finished_loads() == (set(), set())  # (in-step: never by request)


def test_a_step_without_a_forward_waits_for_an_asynchronous_load_instead_of_spinning(
        workers, tmp_path):
    # vLLM steps without pause while its only request waits for our load; each such step
    # asks for finished loads. Returning at once kept the engine thread spinning (holding
    # the GIL our reads need): each call now waits for the load, at most IDLE_WAIT_S.
    engine, worker, hashes, originals = _on_disk_only(workers, tmp_path, b"idle")
    worker.start_loads({"r": {0: (hashes, [5, 6, 7, 8])}})
    started, calls, finished = time.monotonic(), 0, set()
    while "r" not in finished:
        assert time.monotonic() - started < 30, "the load never finished"
        finished |= worker.finished_loads(idle=True)[0]
        calls += 1
    waited = time.monotonic() - started
    assert calls <= 2 + waited / IDLE_WAIT_S  # every call waited (or the load landed)
    for block, original in zip((5, 6, 7, 8), originals):
        assert same_bytes(engine.block_bytes(0, block), original)


@pytest.mark.parametrize("value", [-1, "fast", True, 11, float("nan")])
def test_a_bad_read_budget_is_refused_by_name(value):
    with pytest.raises(ConfigError, match="in_step_read_s"):
        parse_config({"cpu_bytes_to_use": 1 << 20, "in_step_read_s": value})


def test_the_read_budget_defaults_to_50_ms_and_zero_turns_in_step_reads_off():
    assert parse_config({"cpu_bytes_to_use": 1 << 20}).in_step_read_s == 0.05
    assert parse_config({"cpu_bytes_to_use": 1 << 20, "in_step_read_s": 0}).in_step_read_s == 0


def test_the_read_rate_is_the_fastest_of_the_recent_reads():
    from kv_offload.store.read_rate import WINDOW, ReadRate

    rate = ReadRate()
    assert rate.bytes_per_s == 0.0
    rate.record(5 << 20, 1.0)  # a first read slowed by the tier's first use: 5 MiB/s
    rate.record(100 << 20, 0.25)  # 400 MiB/s
    rate.record(0, 0.1)  # (nothing landed: no sample)
    assert rate.bytes_per_s == 400 * 2**20
    for _ in range(WINDOW):  # the tier slowed down for good: the figure follows
        rate.record(50 << 20, 1.0)
    assert rate.bytes_per_s == 50 * 2**20
