"""Our threads leave the cores vLLM pins its forward pass to (real threads, real affinity)."""

from __future__ import annotations

import os
import threading

import pytest

from kv_offload.runtime.affinity import cpus_for_our_threads, parse_cpu_list, spread_threads

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")


def test_cpu_lists_parse_as_linux_writes_them():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}
    with pytest.raises(ValueError):
        parse_cpu_list("\n")


def _in_pinned_thread(cpus, fn):
    """Run `fn` in a thread pinned to `cpus` (as vLLM's CPU worker pins its own)."""
    out = {}

    def run():
        os.sched_setaffinity(0, cpus)
        out["result"] = fn()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out["result"]


def _thread_started_inside(engine_pins_threads: bool = True):
    """Start a thread inside `spread_threads()`; its affinity, and the caller's after."""
    seen = {}
    with spread_threads(engine_pins_threads):
        thread = threading.Thread(target=lambda: seen.update(child=os.sched_getaffinity(0)))
        thread.start()
        thread.join()
    return seen["child"], os.sched_getaffinity(0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_threads_started_by_a_pinned_engine_thread_run_on_the_other_cpus():
    allowed = os.sched_getaffinity(0)
    engine_cpu = {min(allowed)}
    child, engine_after = _in_pinned_thread(engine_cpu, _thread_started_inside)
    assert child == allowed - engine_cpu
    assert engine_after == engine_cpu  # the engine thread's own pinning is restored


def test_an_unpinned_engine_thread_is_left_alone():
    allowed = os.sched_getaffinity(0)
    if cpus_for_our_threads() is not None:
        pytest.skip("this process is pinned to fewer CPUs than its cgroup allows")
    child, after = _thread_started_inside()
    assert child == allowed and after == allowed


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_a_pinning_the_engine_did_not_make_is_kept_for_our_threads():
    """(A GPU worker bound by `taskset` or NUMA binding: the user chose those CPUs.)"""
    user_cpu = {min(os.sched_getaffinity(0))}
    child, after = _in_pinned_thread(user_cpu, lambda: _thread_started_inside(False))
    assert child == user_cpu and after == user_cpu


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_io_threads_a_tier_starts_later_also_run_off_the_engine_cores(tmp_path):
    from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig

    from helpers.tier_helpers import chunk, write

    allowed = os.sched_getaffinity(0)
    engine_cpu = {min(allowed)}

    def open_then_write_later():
        earlier = {t.ident for t in threading.enumerate()}  # (other tests' tiers' threads)
        with spread_threads():  # the tier is opened here (as the worker does)...
            tier = FilesystemTier(FilesystemTierConfig(str(tmp_path), "m", 1 << 30,
                                                       rescan_interval_s=0))
        key, data = chunk(1, 8192)
        assert write(tier, [key], [data]).ok  # ...its pool starts its workers only now
        pool = [t for t in threading.enumerate()
                if t.name.startswith("kv-fs-io") and t.ident not in earlier]
        found = {t.name: os.sched_getaffinity(t.native_id) for t in pool}
        tier.close()
        return found

    found = _in_pinned_thread(engine_cpu, open_then_write_later)
    assert found and all(cpus == allowed - engine_cpu for cpus in found.values()), found
