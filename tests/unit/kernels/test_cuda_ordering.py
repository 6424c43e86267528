"""The GPU path's ordering, executed on the host (host_cuda.py): copies wait on the
engine's stream through an event (no host synchronise), several jobs per direction
are in flight at once, completion is seen through event queries, and descriptor
buffers go back to their pool only once their job is seen complete."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

from kv_offload import FullAttentionSpec, KVCacheGroup, canonicalize
from kv_offload.errors import TransferError
from kv_offload.kernels import BlockCopier, Direction, HostSlotLayout
from kv_offload.store.host import HostTier
from kv_offload.testing.engine_alloc import allocate_kv_caches

from helpers.host_cuda import HostCudaRuntime
from helpers.host_kernel import compiler
from unit.kernels.test_kernels import randomize, reference_load, reference_store
from unit.store.host.test_cpu_backend import logical_pool

pytestmark = pytest.mark.skipif(compiler() is None,
                                reason="needs a C++ compiler to build the copy kernel")
WAIT_S = 30


def small_model(num_blocks: int = 16, layers: int = 4):
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)
    groups = [KVCacheGroup([f"l{i}" for i in range(layers)], spec)]
    buffer, caches = allocate_kv_caches(groups, num_blocks, "LBNHC")
    randomize(buffer, 1)
    return buffer, canonicalize(caches, groups, num_blocks)


@pytest.fixture
def gpu_backend():
    """A HostTier on the GPU path over host memory; the engine stream is the
    runtime's `engine` stream."""
    buffer, canonical = small_model()
    runtime = HostCudaRuntime()
    runtime.register(buffer)
    backend = HostTier(canonical, 12 * canonical.slot_bytes_per_block(0), runtime=runtime)
    yield backend, runtime, buffer, canonical
    runtime.release(runtime.engine)
    backend.close()


def settle(backend: HostTier, in_flight: int) -> None:
    """Wait until the workers have enqueued everything (`in_flight` jobs wait on GPU)."""
    deadline = time.monotonic() + WAIT_S
    while backend.jobs_in_flight != in_flight:
        assert time.monotonic() < deadline, "the workers did not enqueue the jobs"
        time.sleep(0.001)


def test_store_waits_on_the_gpu_for_the_forward_recorded_on_the_engine_stream(gpu_backend):
    backend, runtime, buffer, canonical = gpu_backend
    forward = buffer.clone()
    randomize(forward, 7)  # what the forward will have written
    runtime.hold(runtime.engine)  # the forward is still running
    runtime.enqueue_host(runtime.engine, lambda: buffer.copy_(forward), "forward")
    ready = backend.engine_ready()
    stores = {0: ([3, 4, 5, 9], [0, 1, 2, 7])}
    job = backend.submit_store(stores, ready=ready)
    settle(backend, 1)
    assert backend.poll() == []  # enqueued, not complete: the copy waits for the forward
    runtime.release(runtime.engine)
    (result,) = backend.wait([job], timeout=WAIT_S)
    assert result.success
    assert torch.equal(buffer, forward)
    assert torch.equal(logical_pool(backend), reference_store(canonical, logical_pool(backend),
                                                              stores))


def test_load_is_ordered_after_the_engine_zeroing_its_blocks(gpu_backend):
    backend, runtime, buffer, canonical = gpu_backend
    stores = {0: ([1, 2], [4, 5])}
    assert backend.wait([backend.submit_store(stores)], timeout=WAIT_S)[0].success
    runtime.hold(runtime.engine)
    runtime.enqueue_host(runtime.engine, buffer.zero_, "zero new blocks")
    loads = {0: ([10, 11], [4, 5])}
    job = backend.submit_load(loads, ready=backend.engine_ready())
    settle(backend, 1)
    runtime.release(runtime.engine)
    assert backend.wait([job], timeout=WAIT_S)[0].success
    loaded = buffer.clone()
    buffer.zero_()  # the reference: the loaded pages over zeroed blocks
    assert torch.equal(loaded, reference_load(canonical, logical_pool(backend), loads, buffer))


def test_the_copy_stream_waits_on_the_engine_event_before_any_copy(gpu_backend):
    backend, runtime, _, _ = gpu_backend
    ready = backend.engine_ready()
    job = backend.submit_store({0: ([0, 1, 2, 6], [0, 1, 2, 3])}, ready=ready)
    assert backend.wait([job], timeout=WAIT_S)[0].success
    calls = runtime.calls
    recorded = calls.index(("record", ready.event.handle, runtime.engine.handle))
    waited = next(i for i, c in enumerate(calls) if c[0] == "wait" and c[2] == ready.event.handle)
    stream = calls[waited][1]
    copies = [i for i, c in enumerate(calls)
              if c[0] in ("memcpy2d", "batch", "launch") and c[1] == stream]
    done = [i for i, c in enumerate(calls) if c[0] == "record" and c[2] == stream]
    assert stream != runtime.engine.handle and copies
    assert recorded < waited < copies[0] <= copies[-1] < done[-1]


def test_several_jobs_per_direction_are_in_flight_and_complete_in_order(gpu_backend):
    backend, runtime, buffer, canonical = gpu_backend
    runtime.hold(runtime.engine)
    jobs, expected = [], logical_pool(backend)
    for i in range(3):
        stores = {0: ([2 * i, 2 * i + 1], [2 * i, 2 * i + 1])}
        expected = reference_store(canonical, expected, stores)
        jobs.append(backend.submit_store(stores, ready=backend.engine_ready()))
    settle(backend, 3)  # all three enqueued while none can complete
    assert backend.poll() == []
    runtime.release(runtime.engine)
    results = backend.wait(jobs, timeout=WAIT_S)
    assert [r.job_id for r in results] == jobs and all(r.success for r in results)
    assert torch.equal(logical_pool(backend), expected)
    assert runtime.count("synchronize") == 0 and runtime.count("query") > 0


def test_the_backend_never_synchronizes_on_the_host(gpu_backend):
    backend, runtime, buffer, _ = gpu_backend
    rng = np.random.default_rng(3)
    for _ in range(5):
        stores = {0: (rng.permutation(16)[:4].tolist(), rng.permutation(12)[:4].tolist())}
        assert backend.wait([backend.submit_store(stores)], timeout=WAIT_S)[0].success
        loads = {0: (rng.permutation(16)[:4].tolist(), stores[0][1])}
        assert backend.wait([backend.submit_load(loads)], timeout=WAIT_S)[0].success
    assert runtime.count("synchronize") == 0


def kernel_copier(num_blocks: int = 16):
    buffer, canonical = small_model(num_blocks)
    runtime = HostCudaRuntime()
    runtime.register(buffer)
    layout = HostSlotLayout.from_canonical(canonical)
    pool = runtime.pinned_empty(num_blocks * layout.slot_bytes).view(torch.int8).view(
        num_blocks, layout.slot_bytes)
    return BlockCopier(canonical, pool, layout, runtime=runtime), runtime, canonical


@pytest.mark.parametrize("observe", ["done", "wait"])
def test_descriptor_buffers_return_only_when_their_job_is_seen_complete(observe):
    copier, runtime, canonical = kernel_copier()
    descriptors = copier.descriptor_pool
    runtime.hold(runtime.engine)
    ready = copier.engine_ready()
    first = {0: ([0, 5, 9], [3, 1, 7])}
    second = {0: ([2, 11], [0, 8])}
    expected = reference_store(canonical, reference_store(canonical, copier.pool, first), second)
    jobs = [copier.submit(copier.plan(Direction.STORE, t), ready, strategy="kernel")
            for t in (first, second)]
    # Both kernels are pending: the second could not take the first one's buffer.
    assert descriptors.allocations == 2 and descriptors.free_buffers == 0
    assert not jobs[0].done()
    runtime.release(runtime.engine)
    for job in jobs:
        assert job.done() if observe == "done" else job.wait() is None
        assert job.error is None
    assert descriptors.free_buffers == 2 and torch.equal(copier.pool, expected)
    for _ in range(3):  # later launches reuse the pinned buffers
        job = copier.submit(copier.plan(Direction.STORE, first), None, strategy="kernel")
        job.wait()
    assert descriptors.allocations == 2 and runtime.pinned_allocations == 3  # + the pool


def test_a_failed_runtime_call_fails_the_job_and_names_its_blocks():
    """Engine memory the runtime does not know: every copy call is refused
    (cudaErrorInvalidValue); the job fails, nothing raises, the next job works."""
    buffer, canonical = small_model()
    runtime = HostCudaRuntime(batch=False)
    with HostTier(canonical, 4 * canonical.slot_bytes_per_block(0),
                    runtime=runtime) as backend:
        (result,) = backend.wait([backend.submit_store({0: ([5, 6], [0, 1])})], timeout=WAIT_S)
        assert not result.success and "outside known memory" in result.error
        assert result.failed_blocks == ((0, (5, 6)),)
        runtime.register(buffer)
        (result,) = backend.wait([backend.submit_store({0: ([5, 6], [0, 1])})], timeout=WAIT_S)
        assert result.success


def test_a_ready_that_is_not_an_engine_ready_fails_the_job(gpu_backend):
    backend, _, _, _ = gpu_backend
    (result,) = backend.wait([backend.submit_store({0: ([1], [1])}, ready="now")])
    assert not result.success and "ready must be an EngineReady" in result.error


def test_a_batch_the_driver_refuses_falls_back_once_for_good(caplog):
    buffer, canonical = small_model()
    runtime = HostCudaRuntime(batch=True, batch_fails=True)
    runtime.register(buffer)
    layout = HostSlotLayout.from_canonical(canonical)
    pool = runtime.pinned_empty(8 * layout.slot_bytes).view(torch.int8).view(8, layout.slot_bytes)
    copier = BlockCopier(canonical, pool, layout, runtime=runtime)
    with caplog.at_level(logging.WARNING, logger="kv_offload.kernels.cuda"):
        # The rule never picks the batch itself: ask for it, the driver refuses it.
        stores = {0: ([1, 2, 3, 4, 5], [0, 1, 2, 3, 4])}
        expected = reference_store(canonical, pool, stores)
        copier.copy(copier.plan(Direction.STORE, stores), "batch")
        assert torch.equal(pool, expected)  # the same copies, another way
        assert "batch" not in copier.last_strategies(Direction.STORE)
        stores = {0: ([8, 9], [5, 6])}
        expected = reference_store(canonical, pool, stores)
        copier.copy(copier.plan(Direction.STORE, stores))
        assert torch.equal(pool, expected)
    assert sum("batched memcpy failed" in r.message for r in caplog.records) == 1
    with pytest.raises(TransferError, match="not available"):
        copier.copy(copier.plan(Direction.STORE, {0: ([1], [1])}), "batch")
