"""benchmarks/bench_step_cost.py at a small scale: its synthetic storage tier keeps the
change-feed contract, and a short run drives real stores, loads and store plans."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import bench_step_cost  # noqa: E402
from step_cost_shared import print_shared  # noqa: E402
from step_cost_tier import SyntheticTier  # noqa: E402


def drain(tier: SyntheticTier, batch: int) -> tuple[list[bytes], list[bytes]]:
    added, removed = [], []
    while changes := tier.take_changes(batch):
        assert len(changes) <= batch
        added += changes.added
        removed += changes.removed
    return added, removed


def test_the_synthetic_tier_streams_its_inventory_once_then_reports_writes_and_evictions():
    inventory = [os.urandom(42) for _ in range(10)]
    tier = SyntheticTier(inventory, page_bytes=64)
    added, removed = drain(tier, 3)
    assert sorted(added) == sorted(inventory) and removed == []
    new = [os.urandom(42) for _ in range(2)]
    tier.submit_write(new, [None, None])  # full: the two oldest keys make room
    assert tier.lookup(new + inventory[:2]) == [True, True, False, False]
    added, removed = drain(tier, 8)
    assert sorted(added) == sorted(new) and sorted(removed) == sorted(inventory[:2])
    assert [r.job_id for r in tier.poll()] == [1]


def test_a_short_run_streams_the_inventory_stores_loads_and_plans_every_prefill_block():
    # (The first requests look up before the inventory has arrived and miss: enough of them
    # and enough steps that later arrivals hit, whatever the threads' timing.)
    args = argparse.Namespace(
        seed=0, model="full", keys=3000, engine_blocks=8000, host_mib=16, requests=24,
        batched_tokens=1024, forward_ms=1.0, warmup_steps=60, steady_steps=10,
        gc_freeze=False, report_cap=None, prefill_tokens=4096, chunk_tokens=512,
        decode_tokens=32, prefill_repeats=1)
    steps = bench_step_cost.run_steps(args)
    first, steady = steps["first_steps"], steps["steady_state"]
    assert first["report_keys"]["sum"] >= args.keys  # the whole inventory was reported
    assert steady["steps"] == args.steady_steps
    assert steps["tier"]["read"] > 0 and steps["tier"]["written"] > 0  # loads and stores ran
    assert steady["scheduler"]["max"] > 0 and steady["worker"]["max"] > 0
    full, hybrid = bench_step_cost.run_prefills(args)
    # 4096 / 16 prompt blocks + 2 decode blocks; the window of 1024 tokens needs every block
    # (hits end on every block), so the hybrid plans both groups' blocks.
    assert full["blocks_planned"] == 4096 // 16 + 32 // 16
    assert hybrid["blocks_planned"] == 2 * full["blocks_planned"]
    assert full["steps"] == 4096 // 512 + 32


@pytest.mark.skipif(__import__("shutil").which("redis-server") is None,
                    reason="no redis-server on PATH (apt-get install -y redis-server)")
def short_valkey_run(**changed) -> argparse.Namespace:
    """The arguments of a short `--tier valkey` run, with `changed` ones."""
    return argparse.Namespace(**{
        **dict(seed=0, model="full", keys=3000, engine_blocks=8000, host_mib=16, requests=24,
               batched_tokens=1024, forward_ms=1.0, warmup_steps=60, steady_steps=10,
               gc_freeze=False, report_cap=None, tier="valkey", writer_rate=50.0,
               delay_keys=5, helpers_niced=True),
        **changed})


def test_a_short_run_over_a_real_valkey_server_finds_another_engines_writes():
    args = short_valkey_run()
    steps = bench_step_cost.run_steps(args)
    assert steps["shared"]["helpers_niced"]
    assert steps["first_steps"]["report_keys"]["sum"] >= args.keys  # the server's keys
    assert steps["tier"]["read_ok"] > 0 and steps["tier"]["write_ok"] > 0  # real I/O ran
    delay = steps["shared"]["delay"]
    assert delay["keys"] == 5 and delay["not_found"] == 0 and delay["max_ms"] < 30_000


@pytest.mark.skipif(__import__("shutil").which("redis-server") is None,
                    reason="no redis-server on PATH (apt-get install -y redis-server)")
def test_delay_keys_zero_skips_the_delay_probe():
    # (its writer, told to write 0 keys, would write until stopped: the run never ended)
    args = short_valkey_run(keys=1000, requests=8, warmup_steps=20, steady_steps=5,
                            delay_keys=0, helpers_niced=False)
    steps = bench_step_cost.run_steps(args)
    assert steps["shared"]["delay"] is None
    print_shared(steps)  # (says it was not measured)


def test_helpers_niced_puts_every_thread_of_the_server_at_nice_19():
    from step_cost_shared import lower_priority

    from kv_offload.backends.valkey.local_server import LocalServer, server_binary

    if server_binary() is None:
        pytest.skip("no redis-server on PATH (apt-get install -y redis-server)")
    with LocalServer() as server:
        pid = server.process.pid
        lower_priority(pid)
        nices = [os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(
            f"/proc/{pid}/task")]
    assert len(nices) > 1, "redis-server runs background threads: every one is reniced"
    assert set(nices) == {19}
