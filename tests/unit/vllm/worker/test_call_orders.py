"""The worker side driven in every order in which vLLM 0.32 and 0.33 call a connector.

A worker's report says how far the step's stores are copied out of engine memory
(`RankReport.reflected_step`); the scheduler's `StoreFence` then lets vLLM reuse those blocks
at once. So the claim must be true the moment it is made, whatever the order of the calls:
with a drafter (EAGLE, MTP, draft model, ngram) vLLM builds the report *before* it hands us
the step's stores (`wait_for_save` deferred past the drafter).

Each test plays an adversarial engine: as soon as a report claims a step, the engine
overwrites that step's blocks (the earliest vLLM could reuse them), then every stored key is
loaded back and compared with the bytes the forward wrote. A claim made before the copy
(or before the submission) leaves garbage under a valid key and fails the comparison.

The orders, read from vLLM's sources (`v1/worker/kv_connector_model_runner_mixin.py` and
`gpu_model_runner.py` in 0.32; `v1/worker/gpu/kv_connector.py` and `gpu/model_runner.py`, the
default V2 runner, in 0.33):
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from kv_offload.vllm.worker.offload_worker import OffloadWorker  # noqa: E402

from unit.vllm.worker.test_worker_side import (  # noqa: E402
    NUM_BLOCKS,
    Engine,
    block_hash,
    make_worker,
    same_bytes,
    wait_loads,
)

# One step, as the sequence of worker-side calls vLLM makes ("forward" is the model's
# forward writing this step's blocks; "draft" the drafter's forward after it).
ORDERS = {
    # 0.32 V1 runner, no drafter, async loads started after the forward launch
    "0.32 V1": ["handle_preemptions", "forward", "start_load_kv", "wait_for_save",
                "get_transfer_results", "build_connector_worker_meta"],
    # 0.32 V1 / 0.33 V2 when the step has sync loads: they start before the forward
    "0.32 V1 sync loads": ["handle_preemptions", "start_load_kv", "forward", "wait_for_save",
                           "get_transfer_results", "build_connector_worker_meta"],
    # 0.32 V1 with speculative_config: finalize (wait_for_save) deferred past the drafter
    "0.32 V1 drafter": ["handle_preemptions", "forward", "start_load_kv",
                        "get_transfer_results", "build_connector_worker_meta", "draft",
                        "wait_for_save"],
    "0.32 V1 drafter sync loads": ["handle_preemptions", "start_load_kv", "forward",
                                   "get_transfer_results", "build_connector_worker_meta",
                                   "draft", "wait_for_save"],
    # 0.33 V2 runner (the default): pre_forward, forward, finish_forward, post_forward
    "0.33 V2": ["handle_preemptions", "forward", "finish_forward", "start_load_kv",
                "wait_for_save", "get_transfer_results", "build_connector_worker_meta"],
    # 0.33 V2 with a speculator: post_forward(defer_finalize=True), then finalize_step()
    "0.33 V2 drafter": ["handle_preemptions", "forward", "finish_forward", "start_load_kv",
                        "get_transfer_results", "build_connector_worker_meta", "draft",
                        "wait_for_save"],
    # Both versions, a step without a forward (no_forward / kv_connector_no_forward)
    "no forward": ["handle_preemptions", "start_load_kv", "wait_for_save",
                   "get_transfer_results", "build_connector_worker_meta"],
}
__doc__ += "".join(f"\n- {name}: {' -> '.join(calls)}" for name, calls in ORDERS.items())



@dataclass(frozen=True)
class Claim:
    reflected: int  # what the report said
    step: int  # the step that built the report
    submitted: int  # the last step whose stores vLLM had handed over by then


BLOCKS_PER_STEP = 2
STEPS = 10  # stores use blocks 0..19; loads land in 20..31


class AdversarialEngine:
    """Steps a worker in one of vLLM's call orders; reuses a stored block the moment a
    report says its step is copied out, and remembers what each stored key must hold."""

    def __init__(self, worker: OffloadWorker, engine: Engine) -> None:
        self.worker, self.engine = worker, engine
        self.step = -1
        self.expected: dict[bytes, list[torch.Tensor]] = {}  # key hash -> the forward's bytes
        self.blocks_of_step: dict[int, list[int]] = {}
        self.submitted = -1  # the last step whose wait_for_save ran
        self.reused_through = -1
        self.claims: list[Claim] = []

    def run_step(self, order: list[str], *, settle: bool = True) -> None:
        """One step in `order`; `settle`: the copies of earlier steps end before it (the
        engine's scheduling and forward take long enough), else they may still run."""
        if settle:
            self.worker.wait_for_engine_copies(timeout_s=10)
        self.step += 1
        step, blocks = self.step, self._blocks(self.step)
        hashes = [block_hash(step * 100 + i) for i in range(len(blocks))]
        for call in order:
            if call == "handle_preemptions":
                self.worker.step_started()  # the fence trusted the reports: no wait
            elif call == "start_load_kv":
                self.worker.begin_step(step)
                self.worker.start_loads({})
            elif call == "forward":
                self._write(blocks, hashes, seed=step)
            elif call == "draft":
                pass  # the drafter's forward: it writes its own cache, not these blocks
            elif call == "wait_for_save":
                # (a step without a forward completes no block: nothing to store)
                self.worker.start_stores({0: (hashes, blocks)} if "forward" in order else {})
                self.submitted = step
            elif call == "get_transfer_results":
                self.worker.finished_loads()
            elif call == "build_connector_worker_meta":
                self._claimed(self.worker.report().reports[self.worker.rank].reflected_step)
            elif call == "finish_forward":
                pass  # (0.33's hook: our stores start in wait_for_save)
            else:
                raise AssertionError(call)

    def _blocks(self, step: int) -> list[int]:
        blocks = list(range(step * BLOCKS_PER_STEP, (step + 1) * BLOCKS_PER_STEP))
        self.blocks_of_step[step] = blocks
        return blocks

    def _write(self, blocks: list[int], hashes: list[bytes], seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in self.engine.groups[0].layer_names:
            cache = self.engine.caches[name]
            cache[blocks] = torch.randint(-128, 128, cache[blocks].shape, dtype=cache.dtype,
                                          generator=generator)
        for h, b in zip(hashes, blocks):
            self.expected[h] = self.engine.block_bytes(0, b)

    def _claimed(self, reflected: int) -> None:
        self.claims.append(Claim(reflected, self.step, self.submitted))
        # The engine reuses the blocks of every step the report claims, at once.
        for step in range(self.reused_through + 1, reflected + 1):
            for name in self.engine.groups[0].layer_names:
                self.engine.caches[name][self.blocks_of_step[step]] = 0x55
        self.reused_through = max(self.reused_through, reflected)

    def load_everything_back(self) -> dict[bytes, bool]:
        """Each stored key loaded into a spare block: does it hold the forward's bytes?"""
        self.worker.wait_for_engine_copies(timeout_s=10)
        same: dict[bytes, bool] = {}
        for h, original in self.expected.items():
            spare = NUM_BLOCKS - 1
            self.worker.start_loads({"check": {0: ([h], [spare])}})
            _, failed = wait_loads(self.worker, {"check"})
            same[h] = not failed and same_bytes(self.engine.block_bytes(0, spare), original)
        return same


@pytest.fixture
def adversary():
    engine = Engine()
    worker = make_worker(engine)
    yield AdversarialEngine(worker, engine)
    worker.shutdown()


def check_claims(adversary: AdversarialEngine) -> None:
    same = adversary.load_everything_back()
    wrong = [h.hex()[:8] for h, ok in same.items() if not ok]
    assert not wrong, f"{len(wrong)} of {len(same)} stored keys hold bytes the engine " \
                      f"overwrote after a report claimed them copied out: {wrong}"
    early = [claim for claim in adversary.claims if claim.reflected > claim.submitted]
    assert not early, f"reports claimed steps whose stores were not even submitted: {early}"
    # Claims do advance once the copies are out (else every step would wait for them).
    reflected = adversary.worker.report().reports[adversary.worker.rank].reflected_step
    assert reflected == adversary.submitted


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_report_never_claims_stores_that_are_not_copied_out(adversary, order):
    for _ in range(STEPS):
        adversary.run_step(ORDERS[order])
    check_claims(adversary)


@pytest.mark.parametrize("seed", range(4))
def test_a_report_never_claims_uncopied_stores_when_the_order_changes_step_to_step(
        adversary, seed):
    # A drafter's engine still has steps without a forward (every request waits for a
    # load), and steps with sync loads come and go with the hits.
    rng = random.Random(seed)
    for _ in range(STEPS):
        adversary.run_step(ORDERS[rng.choice(list(ORDERS))], settle=rng.random() < 0.5)
    check_claims(adversary)
