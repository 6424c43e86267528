"""Layer-wise in-step loads and stores (worker_layers.py, store/host/layer_copies.py) on
real CPU tensors laid out like vLLM 0.32's CPU backend, with the real host tier and its
real copy threads, driven in vLLM's per-layer call order: `wait_for_layer_load(i)` before
layer i's forward, `save_kv_layer(i)` after it.

Where a test must hold later layers in flight, the worker hands its copy thread gated
steps (`PacedWorker`): the test, not a clock, decides when layer i may be copied, so
"layer i is readable while layer i+1 is not there yet" is a fact, not a race. Bytes are
checked against the engine's own per-layer views (`Engine.block_bytes`), an independent
reading of the same memory.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from kv_offload.config import OffloadConfig  # noqa: E402
from kv_offload.specs import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec  # noqa: E402
from kv_offload.store.host.layer_copies import LayerSteps  # noqa: E402
from kv_offload.vllm.worker.offload_worker import OffloadWorker  # noqa: E402

from unit.vllm.worker.test_call_orders import ORDERS, STEPS, AdversarialEngine, check_claims  # noqa: E402
from unit.vllm.worker.test_worker_side import (  # noqa: E402
    ATTN,
    NUM_BLOCKS,
    Engine,
    block_hash,
    same_bytes,
    store,
)

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
GROUPS = [KVCacheGroup(LAYERS, FullAttentionSpec(**ATTN))]
BLOCKS = [10, 11, 12]  # where the in-step load lands
HASHES = [block_hash(i) for i in range(3)]


class PacedWorker(OffloadWorker):
    """An OffloadWorker whose in-step loads are copied a layer at a time only as the test
    opens each layer (`steps`), so later layers stay in flight as long as the test wants."""

    steps: LayerSteps | None = None

    def _layer_steps_for_load(self) -> LayerSteps | None:
        if not self.layer_wise:
            return None
        self.steps = LayerSteps(len(LAYERS), gated=True)
        return self.steps


def start(engine: Engine, cls=OffloadWorker, **config) -> OffloadWorker:
    config = {"layer_wise": True, **config}
    worker = cls(OffloadConfig(cpu_bytes_to_use=1 << 20, **config), 0, "test-model")
    worker.register(engine.caches, engine.groups, NUM_BLOCKS)
    return worker


def stored_then_zeroed(engine: Engine, worker: OffloadWorker) -> list[list[torch.Tensor]]:
    """Blocks 1..3 stored under HASHES (whole-step), the load's targets zeroed: the bytes
    each target block must hold per layer once loaded."""
    originals = [engine.block_bytes(0, b) for b in (1, 2, 3)]
    store(worker, {0: (HASHES, [1, 2, 3])})
    engine.zero(0, BLOCKS)
    return originals


def layer_bytes(engine: Engine, layer: int) -> list[torch.Tensor]:
    return [engine.block_bytes(0, b)[layer] for b in BLOCKS]


def test_a_layer_is_readable_after_its_wait_while_later_layers_are_still_in_flight(workers):
    engine = Engine(GROUPS)
    worker = start(engine, PacedWorker)
    workers.append(worker)
    assert worker.layer_wise
    originals = stored_then_zeroed(engine, worker)
    worker.start_loads({"r": {0: (HASHES, BLOCKS)}}, in_step=["r"])  # returns at once
    worker.steps.open(0)
    worker.steps.open(1)
    worker.wait_for_layer(LAYERS[0])
    worker.wait_for_layer(LAYERS[1])
    for layer in (0, 1):  # readable: every block of the layer is there
        assert all(same_bytes([got], [want[layer]])
                   for got, want in zip(layer_bytes(engine, layer), originals))
    for layer in (2, 3):  # still in flight: nothing of them has arrived
        assert all(not got.any() for got in layer_bytes(engine, layer))

    returned = threading.Event()
    waiter = threading.Thread(target=lambda: (worker.wait_for_layer(LAYERS[2]),
                                              worker.wait_for_layer(LAYERS[3]),
                                              returned.set()))
    waiter.start()
    assert not returned.wait(0.3), "wait_for_layer_load returned before its layer arrived"
    worker.steps.open_all()
    waiter.join(10)
    assert returned.is_set()
    for b, original in zip(BLOCKS, originals):
        assert same_bytes(engine.block_bytes(0, b), original)
    assert worker.take_block_errors() == set()


def test_a_load_that_fails_in_a_layer_reports_every_block_of_it_as_a_load_error(workers):
    engine = Engine(GROUPS)
    worker = start(engine, PacedWorker)
    workers.append(worker)
    worker.store.cpu.gate_timeout_s = 0.2  # layer 2 never gets its turn: the copy fails
    stored_then_zeroed(engine, worker)
    worker.start_loads({"r": {0: (HASHES, BLOCKS)}}, in_step=["r"])
    worker.steps.open(0)
    worker.steps.open(1)
    for name in LAYERS:  # the forward goes on; no hook raises or hangs
        worker.wait_for_layer(name)
    worker.start_stores({})
    assert worker.take_block_errors() == set(BLOCKS)  # vLLM recomputes them all
    assert worker.finished_loads() == (set(), set())  # by block, not by request


def test_a_forward_that_skips_a_layers_hook_gets_its_layer_wise_loads_recomputed(workers):
    # (a path that does not call wait_for_layer_load, e.g. a CUDA graph replay, may have
    # read that layer before it arrived)
    engine = Engine(GROUPS)
    worker = start(engine)
    workers.append(worker)
    stored_then_zeroed(engine, worker)
    worker.start_loads({"r": {0: (HASHES, BLOCKS)}}, in_step=["r"])
    for name in LAYERS[:-1]:
        worker.wait_for_layer(name)
    assert worker.take_block_errors() == set(BLOCKS)

    worker.start_loads({"s": {0: (HASHES, [20, 21, 22])}}, in_step=["s"])
    for name in LAYERS:  # every hook called: nothing to recompute
        worker.wait_for_layer(name)
    assert worker.take_block_errors() == set()


def test_a_stored_layer_is_copied_out_before_the_forward_ends_and_no_layer_before_it_is_done(
        workers):
    engine = Engine(GROUPS)
    worker = start(engine)
    workers.append(worker)
    blocks, stores = [4, 5], {0: (HASHES[:2], [4, 5])}
    written = []
    for i, name in enumerate(LAYERS):  # the forward: layer i written, then save_kv_layer(i)
        engine.caches[name][blocks] = torch.full_like(engine.caches[name][blocks], i + 1)
        written.append([engine.caches[name][b].view(torch.uint8).clone() for b in blocks])
        worker.layer_saved(name, stores, step=0)
        if i == 0:
            deadline = time.monotonic() + 10
            while not worker.store_layers_copied():  # layer 0 out, mid-forward
                assert time.monotonic() < deadline, "layer 0 was not copied before the end"
                time.sleep(0.002)
            assert worker.store_layers_copied() == 1  # layer 1 is not released yet
            assert worker.report().reports[0].reflected_step < 0  # nothing claimed yet
            # (the forward never touches layer 0 again: what is stored is what it wrote)
            engine.caches[name][blocks] = 0x55
    worker.begin_step(0)
    worker.start_stores(stores)  # wait_for_save: releases the rest
    worker.wait_for_engine_copies(timeout_s=10)
    worker.start_loads({"r": {0: (HASHES[:2], [20, 21])}}, in_step=["r"])
    for name in LAYERS:
        worker.wait_for_layer(name)
    assert worker.take_block_errors() == set()
    for layer in range(len(LAYERS)):
        for b, want in zip([20, 21], written[layer]):
            assert torch.equal(engine.block_bytes(0, b)[layer], want), (layer, b)


class LayerWiseEngine(AdversarialEngine):
    """The adversarial engine of test_vllm_call_orders, whose forward calls
    `save_kv_layer` after each layer (and `wait_for_layer_load` before it)."""

    def _write(self, blocks, hashes, seed):
        generator = torch.Generator().manual_seed(seed)
        for name in self.engine.groups[0].layer_names:
            self.worker.wait_for_layer(name)
            cache = self.engine.caches[name]
            cache[blocks] = torch.randint(-128, 128, cache[blocks].shape, dtype=cache.dtype,
                                          generator=generator)
            self.worker.layer_saved(name, {0: (hashes, blocks)}, self.step)
            self.claim_now()  # a report mid-forward (the adversary reuses what it claims)
        for h, b in zip(hashes, blocks):
            self.expected[h] = self.engine.block_bytes(0, b)

    def claim_now(self) -> None:
        self._claimed(self.worker.report().reports[self.worker.rank].reflected_step)


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_report_never_claims_layer_wise_stores_before_they_are_copied_out(order):
    engine = Engine(GROUPS)
    worker = start(engine)
    try:
        assert worker.layer_wise
        adversary = LayerWiseEngine(worker, engine)
        for _ in range(STEPS):
            adversary.run_step(ORDERS[order], settle=False)
        check_claims(adversary)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("why", ["two groups", "knob off"])
def test_where_layers_cannot_be_cut_an_in_step_load_ends_before_the_forward(workers, why):
    groups = GROUPS
    if why == "two groups":  # (groups overlay the same bytes: no per-layer cut)
        window = SlidingWindowSpec(sliding_window=32, **ATTN)
        groups = [KVCacheGroup(LAYERS[:2], window),
                  KVCacheGroup(LAYERS[2:], FullAttentionSpec(**ATTN))]
    engine = Engine(groups)
    worker = start(engine, layer_wise=why != "knob off")
    workers.append(worker)
    assert not worker.layer_wise
    originals = stored_then_zeroed(engine, worker)
    worker.start_loads({"r": {0: (HASHES, BLOCKS)}}, in_step=["r"])
    # no hook called yet: the whole load is in engine memory already
    for b, original in zip(BLOCKS, originals):
        assert same_bytes(engine.block_bytes(0, b), original)
    assert worker.take_block_errors() == set()


class FailingWorker(OffloadWorker):
    """A worker whose step start and error report both fail (as the fault-injection e2e
    test makes them fail, in the same step)."""

    def begin_step(self, step: int) -> None:
        raise RuntimeError("injected: begin_step")

    def take_block_errors(self) -> set[int]:
        raise RuntimeError("injected: take_block_errors")


@pytest.mark.parametrize("layer_wise", [True, False])
def test_when_the_worker_can_neither_start_nor_report_in_step_loads_all_their_blocks_recompute(
        workers, layer_wise):
    from kv_offload.vllm.connector import KVOffloadConnector
    from kv_offload.vllm.metadata import KVOffloadMetadata

    engine = Engine(GROUPS)
    worker = start(engine, FailingWorker, layer_wise=layer_wise)
    workers.append(worker)
    stored_then_zeroed(engine, worker)
    # The connector's own methods over the real worker (its vLLM-facing constructor needs
    # a running vLLM; the routing under test does not).
    connector = KVOffloadConnector.__new__(KVOffloadConnector)
    connector._worker, connector._faults = worker, worker.faults
    connector.bind_connector_metadata(KVOffloadMetadata(
        loads={"r": {0: (HASHES, BLOCKS)}}, in_step=["r"], failed_blocks=[7], step=1))
    connector.start_load_kv(None)  # contained: the worker never saw these loads
    for name in LAYERS:
        connector.wait_for_layer_load(name)
    assert connector.get_block_ids_with_load_errors() == {*BLOCKS, 7}
