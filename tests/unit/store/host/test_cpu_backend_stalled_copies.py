"""HostTier when a copy thread stalls (the OS does not run it, a page fault that takes
seconds): the caller stops waiting at its bound, yet the job ends only once nothing of it
touches memory any more, and a copy given up on writes nothing more. Real threads and
real copies; the stall is a share held at its start until the test releases it (what an
OS that does not schedule that thread looks like to us)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kv_offload.canonical import canonicalize
from kv_offload.kernels import cpu as cpu_kernels
from kv_offload.specs import FullAttentionSpec, KVCacheGroup
from kv_offload.store.host import HostTier
from kv_offload.store.host.layer_copies import LayerSteps
from kv_offload.testing.engine_alloc import allocate_kv_caches
from kv_offload.transfer import Direction

from unit.kernels.test_kernels import randomize, reference_load
from unit.store.host.test_cpu_backend import gemma_model, logical_pool

WAIT_S = 30  # generous: only reached if something hangs
BOUND_S = 0.3  # the copy bound under test


class Stall:
    """Holds the first `count` shares that start, at their start, until `release()` (later
    ones run at once). `inside_op`: the held shares then run every op even if their copy
    was given up meanwhile, as a thread already inside its op when that happened does
    (the op in progress cannot be stopped)."""

    def __init__(self, monkeypatch, count: int = 1, inside_op: bool = False) -> None:
        self._left = count
        self._lock = threading.Lock()
        self.held = threading.Event()  # a share is being held now
        self._release = threading.Event()
        run_ops = cpu_kernels._run_ops

        def held_run_ops(ops, cancelled):
            with self._lock:
                hold, self._left = self._left > 0, self._left - 1
            if hold:
                self.held.set()
                self._release.wait(WAIT_S)
                if inside_op:
                    cancelled = threading.Event()  # (never set: nothing stops it now)
            return run_ops(ops, cancelled)

        monkeypatch.setattr(cpu_kernels, "_run_ops", held_run_ops)

    def release(self) -> None:
        self._release.set()


@pytest.fixture
def gemma():
    return gemma_model()


def in_thread(fn) -> list:
    """Run `fn` on its own thread; its return value lands in the list once it returns."""
    out: list = []
    threading.Thread(target=lambda: out.append(fn()), daemon=True).start()
    return out


def returned(out: list, patience_s: float = 10.0) -> bool:
    """Whether the call of `in_thread` returned within `patience_s` (far past the bound
    under test, far short of how long a share is held)."""
    pause = threading.Event()
    for _ in range(int(patience_s / 0.01)):
        if out:
            return True
        pause.wait(0.01)
    return False


def test_an_inline_load_past_its_bound_returns_but_ends_only_after_its_stalled_copy(
        gemma, monkeypatch):
    model, canonical = gemma
    with HostTier(canonical, 10 << 20, copy_timeout_s=BOUND_S) as backend:
        (stored,) = backend.wait([backend.submit_store({0: ([7, 2], [4, 0])})], timeout=WAIT_S)
        assert stored.success
        randomize(model.buffer, 3)  # engine memory now differs from slots 4 and 0
        before = model.buffer.clone()
        stall = Stall(monkeypatch, count=backend.copier._cpu.threads)  # every share
        out = in_thread(lambda: backend.submit(Direction.LOAD, {0: ([3, 11], [4, 0])},
                                               inline=True))
        # The engine's thread is back at the bound while the copy thread is still held...
        assert returned(out), "the caller waited for a stalled copy past its bound"
        assert stall.held.is_set()
        # ...but the job has no result yet: its slots and blocks are still in use.
        assert backend.poll() == []
        stall.release()
        (result,) = backend.wait(out, timeout=WAIT_S)
        assert not result.success and "TimeoutError" in result.error
        assert result.failed_blocks == ((0, (3, 11)),)
        # Given up at the bound: the released share ran no op (vLLM recomputes those blocks).
        assert torch.equal(model.buffer, before)
        # The backend goes on.
        (later,) = backend.wait([backend.submit(Direction.LOAD, {0: ([5], [4])}, inline=True)],
                                timeout=WAIT_S)
        assert later.success


def test_a_cancelled_job_queued_behind_a_stalled_one_never_copies(gemma, monkeypatch):
    model, canonical = gemma
    with HostTier(canonical, 10 << 20, copy_timeout_s=WAIT_S) as backend:
        (stored,) = backend.wait([backend.submit_store({0: ([7, 2], [4, 0])})], timeout=WAIT_S)
        assert stored.success
        randomize(model.buffer, 3)
        expected = reference_load(canonical, logical_pool(backend), {0: ([3], [4])},
                                  model.buffer)  # (after the first job alone)
        stall = Stall(monkeypatch)
        first = backend.submit(Direction.LOAD, {0: ([3], [4])})  # the job thread's: held
        assert stall.held.wait(WAIT_S)
        second = backend.submit(Direction.LOAD, {0: ([11], [0])})  # queued behind it
        backend.cancel(second)  # its caller gave it up (e.g. an in-step load past its bound)
        stall.release()
        done, given_up = backend.wait([first, second], timeout=WAIT_S)
        assert done.success
        assert not given_up.success and "cancelled" in given_up.error
        assert given_up.failed_blocks == ((0, (11,)),)
        # Only the first job's block changed: the cancelled one wrote nothing.
        assert torch.equal(model.buffer, expected)


def test_close_does_not_wait_forever_for_a_stalled_copy(gemma, monkeypatch):
    _, canonical = gemma
    backend = HostTier(canonical, 10 << 20, copy_timeout_s=BOUND_S, close_timeout_s=BOUND_S)
    stall = Stall(monkeypatch)
    job = backend.submit(Direction.LOAD, {0: (np.array([3]), np.array([4]))}, inline=True)
    assert stall.held.is_set()
    out = in_thread(lambda: backend.close() or "closed")
    try:
        assert returned(out), "close() waited for a stalled copy thread"
        (result,) = backend.poll()
        assert result.job_id == job and not result.success
    finally:
        stall.release()


def test_a_load_cut_per_layer_that_is_cancelled_copies_no_further_layer(monkeypatch):
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    layers = [f"layers.{i}.attn" for i in range(4)]
    buffer, caches = allocate_kv_caches([KVCacheGroup(layers, spec)], 16, "LBHNC")
    randomize(buffer, 5)
    canonical = canonicalize(caches, [KVCacheGroup(layers, spec)], 16)
    with HostTier(canonical, 4 * 4 * spec.page_size_bytes, copy_timeout_s=WAIT_S) as backend:
        assert backend.layer_copier is not None  # (this view is cut per layer)
        (stored,) = backend.wait([backend.submit_store({0: ([1, 2], [0, 1])})], timeout=WAIT_S)
        assert stored.success
        randomize(buffer, 6)
        before = buffer.clone()
        stall = Stall(monkeypatch)  # holds layer 0's copy
        steps = LayerSteps.for_load(len(layers))
        job = backend.submit(Direction.LOAD, {0: ([7, 8], [0, 1])}, layers=steps)
        assert stall.held.wait(WAIT_S)
        backend.cancel(job)  # (the worker gave the load up)
        stall.release()
        (result,) = backend.wait([job], timeout=WAIT_S)
        assert not result.success and "cancelled" in result.error
        assert steps.num_copied == 0
        assert torch.equal(buffer, before)  # no layer was written
