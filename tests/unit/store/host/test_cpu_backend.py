"""HostTier: asynchronous stores and loads on real worker threads, failures as
failed jobs, overlapping stores and loads, the byte budget."""

from __future__ import annotations

import importlib.util
import threading
import time

import numpy as np
import pytest
import torch

from kv_offload import canonicalize
from kv_offload.errors import ConfigError, TierClosedError, TransferError
from kv_offload.store.host import HostTier
from kv_offload.testing.example_models import build_example
from kv_offload.transfer import Direction

from unit.kernels.test_kernels import engine_page, randomize, reference_load, reference_store

WAIT_S = 60  # generous: only reached if a worker hangs


def logical_pool(backend: HostTier) -> torch.Tensor:
    """The pool as the manager sees it: row i holds slot i (a copy)."""
    return backend.pool[torch.from_numpy(backend.pool_rows(np.arange(backend.num_slots)))]


def gemma_model():
    """A Gemma-3-like engine (12 blocks, random bytes) and its canonical view."""
    model = build_example("gemma3", 12)
    randomize(model.buffer, 1)
    canonical = canonicalize(model.kv_caches, model.groups, model.num_blocks)
    return model, canonical


@pytest.fixture
def gemma():
    return gemma_model()


def test_store_scribble_load_round_trip(gemma):
    model, canonical = gemma
    with HostTier(canonical, 10 * (1 << 20)) as backend:
        assert backend.num_slots == 10 and backend.slot_bytes == 1 << 20
        stores = {0: ([7, 2, 9], [4, 0, 8]), 3: ([5], [1])}  # overlaid groups, one job
        expected_pool = reference_store(canonical, logical_pool(backend), stores)
        job = backend.submit_store(stores)
        (result,) = backend.wait([job], timeout=WAIT_S)
        assert result.success and result.direction is Direction.STORE
        assert result.num_bytes == 4 * canonical.data_bytes_per_block(0) and result.seconds >= 0
        assert torch.equal(logical_pool(backend), expected_pool)
        randomize(model.buffer, 2)
        loads = {0: ([3, 11], [8, 4]), 3: ([6], [1])}  # partial batch into other blocks
        expected = reference_load(canonical, logical_pool(backend), loads, model.buffer)
        (result,) = backend.wait([backend.submit_load(loads)], timeout=WAIT_S)
        assert result.success and result.direction is Direction.LOAD
        assert torch.equal(model.buffer, expected)


@pytest.mark.parametrize("transfers, message", [
    ({0: ([12], [0])}, "block id 12 is out of range"),
    ({0: ([1], [10])}, "slot id 10 is out of range"),
    ({0: ([1.0], [2])}, "ids must be a 1-D sequence of ints"),
    ({0: ([1, 2], [3])}, "2 block ids but 1 slot ids"),
    ({9: ([1], [3])}, "cache group 9 does not exist"),
    ({0: [1, 3]}, "expected (block_ids, slot_ids)"),
    ([(0, [1], [2])], "transfers must map group"),
])
def test_bad_jobs_fail_without_raising(gemma, transfers, message):
    _, canonical = gemma
    with HostTier(canonical, 10 << 20) as backend:
        before = backend.pool.clone()
        job = backend.submit_store(transfers)
        (result,) = backend.wait([job], timeout=WAIT_S)
        assert not result.success and result.num_bytes == 0
        assert result.error.startswith("TransferError") and message in result.error
        assert torch.equal(backend.pool, before)


def test_failed_job_names_its_blocks(gemma):
    _, canonical = gemma
    with HostTier(canonical, 10 << 20) as backend:
        job = backend.submit_load({0: ([3, 4], [1, 1]), 2: ([5], [99])})
        (result,) = backend.wait([job], timeout=WAIT_S)
        assert not result.success
        assert dict(result.failed_blocks) == {0: (3, 4), 2: (5,)}


@pytest.mark.parametrize("direction, inline", [(Direction.STORE, False),
                                               (Direction.LOAD, False), (Direction.LOAD, True)])
def test_exception_inside_the_copy_is_a_failed_job(direction, inline):
    model = build_example("llama-8b", 4)
    canonical = canonicalize(model.kv_caches, model.groups, 4)
    with HostTier(canonical, 4 << 21) as backend:
        model.buffer.untyped_storage().resize_(0)  # the engine memory is gone
        job = backend.submit(direction, {0: ([1, 2], [0, 1])}, inline=inline)  # never raises
        (result,) = backend.wait([job], timeout=WAIT_S)
        assert not result.success and "RuntimeError" in result.error
        assert result.failed_blocks == ((0, (1, 2)),)
        # The backend keeps working after a failed job.
        (ok,) = backend.wait([backend.submit_store({})], timeout=WAIT_S)
        assert ok.success and ok.num_bytes == 0


def test_an_inline_load_is_copied_on_the_calling_thread_before_submit_returns(gemma):
    # An in-step load on a CPU engine: the engine thread would only wait for the job
    # thread, so it copies itself (one thread hand-off less); a bad job is still a failed
    # result, never an exception.
    model, canonical = gemma
    with HostTier(canonical, 10 << 20) as backend:
        (stored,) = backend.wait([backend.submit_store({0: ([7, 2], [4, 0])})], timeout=WAIT_S)
        assert stored.success
        randomize(model.buffer, 3)
        loads = {0: ([3, 11], [4, 0])}
        expected = reference_load(canonical, logical_pool(backend), loads, model.buffer)
        copiers = []
        copy = backend._start  # (the job thread's entry point, wrapped to see its thread)
        backend._start = lambda queued: (copiers.append(threading.current_thread()),
                                         copy(queued))[1]
        job = backend.submit(Direction.LOAD, loads, inline=True)
        assert torch.equal(model.buffer, expected)  # in engine memory at return
        assert copiers == [threading.current_thread()]
        (result,) = backend.poll()
        assert result.job_id == job and result.success
        bad = backend.submit(Direction.LOAD, {0: ([3], [99])}, inline=True)
        (failed,) = backend.poll()
        assert failed.job_id == bad and not failed.success and "slot id 99" in failed.error
        queued = backend.submit(Direction.LOAD, loads)  # (not inline: the job thread's)
        assert backend.wait([queued], timeout=WAIT_S)[0].success
        assert copiers[-1] is not threading.current_thread()


def test_an_inline_load_whose_copy_threads_are_stuck_fails_within_its_bound(gemma):
    # The engine thread copies an inline load itself: a stuck copy thread must fail the job
    # (its blocks recompute), not hold the engine, as the worker's bound does for queued ones.
    _, canonical = gemma
    with HostTier(canonical, 10 << 20, copy_timeout_s=0.5) as backend:
        copier = backend.copier._cpu
        release = threading.Event()
        stuck = [copier._pool(Direction.LOAD).submit(release.wait) for _ in range(copier.threads)]
        outcome = []
        caller = threading.Thread(target=lambda: outcome.append(
            backend.submit(Direction.LOAD, {0: ([3, 11], [4, 0])}, inline=True)), daemon=True)
        caller.start()
        caller.join(timeout=10)  # (the bound is 0.5 s; the stuck threads hold until released)
        try:
            assert outcome, "an inline load waited for its stuck copy threads past its bound"
            (result,) = backend.poll()
            assert result.job_id == outcome[0] and not result.success
            assert "TimeoutError" in result.error and result.failed_blocks == ((0, (3, 11)),)
        finally:
            release.set()
        for future in stuck:
            future.result(timeout=WAIT_S)
        (later,) = backend.wait([backend.submit(Direction.LOAD, {0: ([5], [4])}, inline=True)],
                                timeout=WAIT_S)
        assert later.success  # the backend goes on


def test_concurrent_stores_and_loads_on_disjoint_memory(gemma):
    model, canonical = gemma
    with HostTier(canonical, 12 << 20) as backend:
        (r,) = backend.wait([backend.submit_store({1: (range(6, 12), range(6, 12))})])
        assert r.success
        store_pairs = {0: (list(range(6))[::-1], list(range(6)))}
        load_pairs = {1: (list(range(6, 12))[::-1], list(range(6, 12)))}
        expected_pool = reference_store(canonical, logical_pool(backend), store_pairs)
        # Group 1's blocks 6..11 and group 0's blocks 0..5 are disjoint engine bytes.
        expected = reference_load(canonical, logical_pool(backend), load_pairs, model.buffer)
        jobs, lock = [], threading.Lock()

        def submit(direction, pairs, count):
            for _ in range(count):
                job = backend.submit(direction, pairs)
                with lock:
                    jobs.append(job)

        threads = [threading.Thread(target=submit, args=(Direction.STORE, store_pairs, 15)),
                   threading.Thread(target=submit, args=(Direction.LOAD, load_pairs, 15))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = backend.wait(jobs, timeout=WAIT_S)
        assert [r.job_id for r in results] == jobs and all(r.success for r in results)
        assert {r.direction for r in results} == {Direction.STORE, Direction.LOAD}
        assert torch.equal(logical_pool(backend), expected_pool)
        assert torch.equal(model.buffer, expected)


def test_poll_returns_each_result_once_and_wait_rejects_unknown_ids(gemma):
    _, canonical = gemma
    backend = HostTier(canonical, 4 << 20)
    ids = [backend.submit_store({0: ([i], [i])}) for i in range(4)]
    assert len(set(ids)) == 4
    seen = {}
    while len(seen) < 4:
        for result in backend.poll():
            assert result.job_id not in seen
            seen[result.job_id] = result
        time.sleep(0.001)
    assert sorted(seen) == sorted(ids) and all(r.success for r in seen.values())
    assert backend.poll() == []
    with pytest.raises(TransferError, match="unknown or its result was already collected"):
        backend.wait([ids[0]])
    late = backend.submit_load({0: ([5], [0])})
    backend.close()  # queued work finishes; its result stays available
    assert [r.job_id for r in backend.poll()] == [late]
    with pytest.raises(TierClosedError):
        backend.submit_store({0: ([1], [1])})
    backend.close()  # idempotent


def test_budget_sizes_the_pool(gemma):
    _, canonical = gemma
    with HostTier(canonical, (3 << 20) + 5) as backend:
        assert backend.num_slots == 3 and tuple(backend.pool.shape) == (3, 1 << 20)
        assert backend.pinned == torch.cuda.is_available()
        assert backend.slot_buffer(2).shape == (1 << 20,)
        assert backend.slot_buffer(2, group=0).data_ptr() == backend.pool[2].data_ptr()
        assert backend.pool_rows([0, 1, 2]).tolist() == [0, 1, 2]
        with pytest.raises(TransferError, match="slot 3 is out of range"):
            backend.slot_buffer(3)
    with pytest.raises(ConfigError, match="smaller than one host slot"):
        HostTier(canonical, (1 << 20) - 1)
    with pytest.raises(ConfigError, match="must be an int"):
        HostTier(canonical, 1.5e9)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                    reason="needs CUDA for pinned memory, and cupy to ask the driver")
def test_pool_is_pinned_with_cuda(gemma):
    _, canonical = gemma
    import cupy

    with HostTier(canonical, 2 << 20) as backend:
        assert backend.pinned
        # The driver's word (torch's is_pinned() can miss memory from cudaHostRegister).
        attributes = cupy.cuda.runtime.pointerGetAttributes(backend.pool.data_ptr())
        assert int(attributes.type) == 1  # cudaMemoryTypeHost


def test_many_random_jobs_match_reference():
    """Stores reuse slots in new orders (each moves its slots' rows around, see
    slots.py); slot buffers and loads always find the right bytes."""
    model = build_example("deepseek-mla", 6)
    randomize(model.buffer, 5)
    canonical = canonicalize(model.kv_caches, model.groups, 6)
    rng = np.random.default_rng(0)
    with HostTier(canonical, 5 * canonical.data_bytes_per_block(0)) as backend:
        expected = logical_pool(backend)
        for _ in range(6):
            blocks = rng.choice(6, size=3, replace=False).tolist()
            slots = rng.choice(5, size=3, replace=False).tolist()
            expected = reference_store(canonical, expected, {0: (blocks, slots)})
            assert backend.wait([backend.submit_store({0: (blocks, slots)})])[0].success
            assert sorted(backend.pool_rows(range(5)).tolist()) == list(range(5))
        assert torch.equal(logical_pool(backend), expected)
        for slot in range(5):
            assert torch.equal(backend.slot_buffer(slot), expected[slot])
        randomize(model.buffer, 6)
        loads = {0: ([5, 0, 3, 1, 2], [0, 1, 2, 3, 4])}
        want = reference_load(canonical, expected, loads, model.buffer)
        assert backend.wait([backend.submit_load(loads)])[0].success
        assert torch.equal(model.buffer, want)


def test_store_reads_engine_memory_in_address_order():
    """A store hands its slots' rows out in block order: slot ids given in any
    order, the rows come out sorted the same way as the blocks."""
    model = build_example("llama-8b", 8)
    canonical = canonicalize(model.kv_caches, model.groups, 8)
    with HostTier(canonical, 4 * canonical.slot_bytes_per_block(0)) as backend:
        blocks, slots = [6, 1, 7, 3], [0, 1, 2, 3]
        assert backend.wait([backend.submit_store({0: (blocks, slots)})])[0].success
        rows = backend.pool_rows(slots)
        assert np.argsort(rows).tolist() == np.argsort(blocks).tolist()


def test_with_the_offload_manager_slots_and_evictions(gemma):
    """Slot ids come from the scheduler-side OffloadManager; evictions reuse slots
    and every key that is still ready loads back its own bytes."""
    from kv_offload.store.manager import OffloadManager

    model, canonical = gemma
    with HostTier(canonical, 4 << 20) as backend:
        manager = OffloadManager(backend.num_slots)
        pages = {}  # key -> the engine bytes of its block when it was stored

        def store(blocks, group, tag):
            keys = [(f"{tag}{b}".encode(), group) for b in blocks]
            plan = manager.prepare_store(keys)
            assert plan is not None and len(plan.slots) == len(blocks)
            by_key = dict(zip(keys, blocks))
            job = backend.submit_store({group: ([by_key[k] for k in plan.keys], plan.slots)})
            (result,) = backend.wait([job], timeout=WAIT_S)
            manager.complete_store(plan.keys, result.success)
            for key in plan.keys:
                refs = canonical.group_refs[group]
                pages[key] = [engine_page(canonical, r, by_key[key]).clone() for r in refs]
            return keys

        first = store([3, 1, 2], 0, "a")
        randomize(model.buffer, 9)
        second = store([7, 8], 2, "b")  # 2 free slots left -> evicts the oldest key
        assert manager.lookup([first[0]])[0].value == "absent"
        ready = [k for k in first + second if manager.is_ready(k)]
        assert len(ready) == 4
        randomize(model.buffer, 10)
        targets = {k: t for k, t in zip(ready, [0, 5, 9, 11])}
        for group in (0, 2):
            keys = [k for k in ready if k[1] == group]
            slots = manager.prepare_load(keys)
            job = backend.submit_load({group: ([targets[k] for k in keys], slots)})
            assert backend.wait([job], timeout=WAIT_S)[0].success
            manager.complete_load(keys)
        for key in ready:
            for ref, page in zip(canonical.group_refs[key[1]], pages[key]):
                assert torch.equal(engine_page(canonical, ref, targets[key]), page)
