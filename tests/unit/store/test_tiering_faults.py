"""Faults at every step of the TieredStore pipeline: each job still ends exactly once, the
bytes it reports loaded are the right ones, and the store keeps serving afterwards.

Real host tier, real filesystem tier on real files, real copy threads; the faults are
raised by the real objects, made to fail on purpose for their first `FAILURES` calls (a
plug-in policy fails once: it is then replaced by LRU):
the storage tier's poll / submit_read / submit_write, the host tier's poll, a plug-in
eviction policy's evict / inserted / touched / admitting, and our own bookkeeping (the
manager unpinning a load's keys).
"""

from __future__ import annotations

import time

import pytest
import torch

from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig
from kv_offload.store.policies import LRUPolicy
from kv_offload.store.tiered import TieredStore, layout_fingerprint

from unit.store.test_tiering import block_bytes, h, hybrid

FAILURES = 2
WAIT_S = 20.0


class Injected(RuntimeError):
    pass


class Arm:
    """Fails the first `FAILURES` calls it is asked about, then lets everything through."""

    def __init__(self) -> None:
        self.left = FAILURES
        self.fired = 0

    def maybe_fail(self, what: str) -> None:
        if self.left > 0:
            self.left -= 1
            self.fired += 1
            raise Injected(f"injected fault: {what}")


class FaultyTier(FilesystemTier):
    def __init__(self, config, arm: Arm, where: str) -> None:
        super().__init__(config)
        self.arm, self.where = arm, where

    def poll(self):
        if self.where == "tier.poll":
            self.arm.maybe_fail("tier.poll")  # before taking results: nothing is lost
        return super().poll()

    def submit_read(self, keys, buffers):
        if self.where == "tier.submit_read":
            self.arm.maybe_fail("tier.submit_read")
        return super().submit_read(keys, buffers)

    def submit_write(self, keys, buffers):
        if self.where == "tier.submit_write":
            self.arm.maybe_fail("tier.submit_write")
        return super().submit_write(keys, buffers)


class FaultyPolicy(LRUPolicy):
    arm: Arm | None = None
    where = ""

    def _maybe(self, method: str) -> None:
        if self.arm is not None and self.where == f"policy.{method}":
            self.arm.maybe_fail(self.where)

    def evict(self, incoming, can_evict):
        self._maybe("evict")
        return super().evict(incoming, can_evict)

    def inserted(self, key):
        self._maybe("inserted")
        super().inserted(key)

    def touched(self, key):
        self._maybe("touched")
        super().touched(key)

    def admitting(self, keys):
        self._maybe("admitting")
        super().admitting(keys)


WHERE = ["tier.poll", "tier.submit_read", "tier.submit_write", "host.poll", "policy.evict",
         "policy.inserted", "policy.touched", "policy.admitting", "bookkeeping",
         "bookkeeping.after_result"]


def build(tmp_path, where: str):
    buffer, canonical = hybrid()
    arm = Arm()
    tier = FaultyTier(FilesystemTierConfig(
        root_dir=str(tmp_path), layout_fingerprint=layout_fingerprint(canonical),
        bytes_to_use=1 << 30, rescan_interval_s=0), arm, where)
    policy = FaultyPolicy(4)
    policy.arm, policy.where = arm, where
    slot = max(canonical.slot_bytes_per_block(g) for g in range(2))
    store = TieredStore(canonical, 4 * slot, storage=tier, eviction_policy=policy,
                        staging_slots=2)
    if where == "host.poll":
        real_poll = store.cpu.poll

        def poll():
            arm.maybe_fail("host.poll")  # before taking results: nothing is lost
            return real_poll()
        store.cpu.poll = poll
    if where == "bookkeeping":
        real = store.manager.complete_load

        def complete_load(keys):
            real(keys)  # unpinned, then the caller's bookkeeping fails
            arm.maybe_fail("bookkeeping")
        store.manager.complete_load = complete_load
    if where == "bookkeeping.after_result":  # fails after the job's result was delivered:
        real_pin = store.manager.prepare_load  # pinning slots for their write-through

        def prepare_load(keys):
            arm.maybe_fail("bookkeeping.after_result")
            return real_pin(keys)
        store.manager.prepare_load = prepare_load
    return buffer, canonical, store, arm


def collect(store: TieredStore, job_ids: list[int]) -> dict:
    """Poll until every job reported; each exactly once, and nothing we did not submit."""
    results: dict = {}
    deadline = time.monotonic() + WAIT_S
    while len(results) < len(job_ids):
        for result in store.poll():
            assert result.job_id in job_ids, f"unknown job {result.job_id}"
            assert result.job_id not in results, f"job {result.job_id} reported twice"
            results[result.job_id] = result
        assert time.monotonic() < deadline, f"jobs never ended: {set(job_ids) - set(results)}"
        time.sleep(0.001)
    time.sleep(0.05)  # nothing more may arrive for them
    assert all(r.job_id not in job_ids for r in store.poll())
    return results


def round_trip(buffer, canonical, store, first: int) -> tuple[int, int]:
    """Store 6 blocks (4 host slots: evictions, write-through), load them all back (staged
    through the host tier from disk), check every block reported loaded is byte-exact.
    Returns (loads that succeeded, blocks that failed)."""
    blocks = list(range(1, 7))
    keys = [h(first + i) for i in range(6)]
    originals = {b: block_bytes(canonical, 0, b) for b in blocks}
    for key, block in zip(keys, blocks):  # one at a time: each is written through
        collect(store, [store.submit_store({0: ([key], [block])})])
        store.flush(timeout=WAIT_S)
    buffer.zero_()
    targets = [7, 8, 9, 10, 11, 0]
    loads = [store.submit_load({0: (keys[:3], targets[:3])}),
             store.submit_load({0: (keys[3:], targets[3:])})]
    results = collect(store, loads)
    landed = {b: block_bytes(canonical, 0, b) for b in targets}
    time.sleep(0.1)  # a copy still in flight after its load was reported would show now
    store.poll()
    assert all(torch.equal(block_bytes(canonical, 0, b), landed[b]) for b in targets)
    ok, failed_blocks = 0, 0
    for job, target_blocks, sources in ((loads[0], targets[:3], blocks[:3]),
                                        (loads[1], targets[3:], blocks[3:])):
        failed = set(results[job].failed.get(0, []))
        failed_blocks += len(failed)
        ok += results[job].success
        for target, source in zip(target_blocks, sources):
            if target not in failed:  # reported loaded: must be the stored bytes
                assert torch.equal(block_bytes(canonical, 0, target), originals[source])
    buffer.copy_(torch.randint(-128, 128, buffer.shape, dtype=torch.int8))
    return ok, failed_blocks


@pytest.mark.parametrize("where", WHERE)
def test_a_fault_at_any_step_ends_each_job_once_and_the_store_keeps_serving(tmp_path, where):
    buffer, canonical, store, arm = build(tmp_path, where)
    try:
        round_trip(buffer, canonical, store, first=0)  # the faults fire here
        if where.startswith("policy"):  # a plug-in that raises is replaced by LRU at once
            assert arm.fired == 1 and store.manager.policy_failures == 1
        else:
            assert arm.fired == FAILURES, f"the {where} fault never fired: test lost its point"
            assert sum(store.faults.take_counts().values()) >= 1, "the faults were not counted"
        ok, failed = round_trip(buffer, canonical, store, first=100)  # faults are over
        assert (ok, failed) == (2, 0)
    finally:
        store.close()
