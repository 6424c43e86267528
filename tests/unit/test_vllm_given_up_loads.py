"""The worker gives an in-step load up at its bound (a slow disk): vLLM is told its blocks
failed and recomputes them, and nothing of that load reaches them afterwards, when the
disk answers at last. Real worker, real disk tier and threads; the disk's results are held
back until the test lets them through."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from test_vllm_worker_side import (  # noqa: E402
    NUM_BLOCKS,
    ON_DISK,
    Engine,
    block_hash,
    make_worker,
    store,
    wait_for_changes,
)

from kv_offload.config import OffloadConfig  # noqa: E402
from kv_offload.vllm.worker_side import OffloadWorker  # noqa: E402

BOUND_S = 0.3  # the worker's copy bound under test


def test_an_in_step_load_past_its_bound_is_recomputed_and_never_written_later(
        workers, tmp_path, monkeypatch):
    engine = Engine()
    first = make_worker(engine, tmp_path)
    workers.append(first)
    hashes = [block_hash(i, b"late") for i in range(2)]
    store(first, {0: (hashes, [1, 2])})
    first.shutdown()  # on disk now
    second = OffloadWorker(OffloadConfig(cpu_bytes_to_use=1 << 20,
                                         fs_root_dir=str(tmp_path / "kv"),
                                         fs_bytes_to_use=64 << 20, in_step_read_s=0),
                           0, "test-model", copy_timeout_s=BOUND_S)
    second.register(engine.caches, engine.groups, NUM_BLOCKS)
    workers.append(second)
    wait_for_changes(second, {(h, 0): ON_DISK for h in hashes})
    flowing = threading.Event()  # set: the disk's results reach the store
    poll = second.store.storage.poll
    monkeypatch.setattr(second.store.storage, "poll",
                        lambda: poll() if flowing.is_set() else [])

    second.start_loads({"r": {0: (hashes, [5, 6])}}, in_step={"r"})  # (back at the bound)
    assert second.take_block_errors() == {5, 6}, "the late blocks were not reported"
    engine.zero(0, [5, 6])  # vLLM's recompute of those blocks (stand-in bytes)
    recomputed = [engine.block_bytes(0, b) for b in (5, 6)]
    flowing.set()
    second.shutdown()  # waits for every job: the given-up load's read lands meanwhile
    workers.remove(second)
    assert [all(torch.equal(x, y) for x, y in zip(engine.block_bytes(0, b), r))
            for b, r in zip((5, 6), recomputed)] == [True, True], \
        "a load given up on wrote its blocks after vLLM recomputed them"
