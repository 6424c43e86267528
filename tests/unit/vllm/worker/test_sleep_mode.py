"""vLLM 0.33's sleep mode: `unregister_kv_caches` before engine memory is unmapped,
`restore_kv_caches` after it is mapped again (the connector routes them to the worker's
`suspend` / `resume`). Between the two, nothing of ours may read or write engine memory."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from kv_offload.vllm.connector import KVOffloadConnector  # noqa: E402

from unit.vllm.worker.test_worker_side import (  # noqa: E402
    NUM_BLOCKS,
    Engine,
    block_hash,
    changes,
    make_worker,
    same_bytes,
    wait_loads,
)

HASHES = [block_hash(i) for i in range(8)]
STORED = list(range(1, 9))


@pytest.fixture
def engine_and_worker():
    engine = Engine()
    worker = make_worker(engine)
    yield engine, worker
    worker.shutdown()


def test_sleep_waits_for_stores_to_copy_out_before_engine_memory_goes(engine_and_worker):
    engine, worker = engine_and_worker
    originals = [engine.block_bytes(0, b) for b in STORED]
    worker.begin_step(0)
    worker.start_stores({0: (HASHES, STORED)})
    worker.suspend()
    engine.zero(0, range(NUM_BLOCKS))  # unmapped: whatever is there now is not the KV
    worker.resume()
    worker.start_loads({"r": {0: (HASHES, list(range(20, 28)))}})
    _, failed = wait_loads(worker, {"r"})
    assert not failed
    for b, original in zip(range(20, 28), originals):
        assert same_bytes(engine.block_bytes(0, b), original)


def test_while_asleep_loads_fail_and_stores_are_skipped_without_touching_the_engine(
        engine_and_worker):
    engine, worker = engine_and_worker
    worker.start_stores({0: (HASHES[:2], STORED[:2])})
    worker.wait_for_engine_copies(timeout_s=10)
    assert set(changes(worker)) == {(h, 0) for h in HASHES[:2]}
    worker.suspend()
    worker.suspend()  # idempotent
    engine.zero(0, range(NUM_BLOCKS))
    worker.start_loads({"r": {0: (HASHES[:2], [20, 21])}})
    assert wait_loads(worker, {"r"}) == ({"r"}, {"r"})  # failed: vLLM recomputes it
    worker.start_stores({0: (HASHES[2:4], STORED[2:4])})
    worker.wait_for_engine_copies(timeout_s=10)
    assert changes(worker) == {}  # nothing stored from unmapped memory
    zero = torch.zeros_like(engine.block_bytes(0, 20)[0])
    assert all(torch.equal(t, zero) for b in (20, 21) for t in engine.block_bytes(0, b))


def test_after_waking_up_hits_stored_before_the_sleep_are_served(engine_and_worker):
    engine, worker = engine_and_worker
    originals = [engine.block_bytes(0, b) for b in STORED[:2]]
    worker.start_stores({0: (HASHES[:2], STORED[:2])})
    worker.suspend()
    engine.zero(0, range(NUM_BLOCKS))  # vLLM dropped its KV at sleep level 1
    worker.resume()
    worker.resume()  # idempotent
    worker.start_loads({"r": {0: (HASHES[:2], [20, 21])}})
    assert wait_loads(worker, {"r"}) == ({"r"}, set())
    assert all(same_bytes(engine.block_bytes(0, b), o) for b, o in zip((20, 21), originals))
    worker.start_stores({0: (HASHES[4:6], STORED[4:6])})  # stores run again
    worker.wait_for_engine_copies(timeout_s=10)
    assert {(h, 0) for h in HASHES[4:6]} <= set(changes(worker))


def test_the_connector_accepts_sleep_mode_and_defines_both_hooks():
    # vLLM 0.33 asks the class at config time; 0.32 never calls any of these.
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(kv_connector="KVOffloadConnector", kv_role="kv_both",
                              kv_connector_extra_config={"cpu_bytes_to_use": "1MiB"})
    assert KVOffloadConnector.supports_sleep_mode(config) is True
    for hook in ("unregister_kv_caches", "restore_kv_caches"):
        assert hook in KVOffloadConnector.__dict__
