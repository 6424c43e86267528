"""Keep our threads off the cores vLLM pinned its forward pass to.

vLLM's CPU worker pins the thread that runs the model (and its OpenMP pool) to chosen
cores. Linux threads inherit the affinity of the thread that creates them, so every thread
the connector starts inside the worker (pump, copy threads, storage I/O) would share those
cores with the forward pass while other cores of the process sit idle. `spread_threads()`
widens the calling thread's affinity, while our threads are created, to the process's other
CPUs, then restores it. Where the engine thread is not pinned to a subset of the process's
CPUs (vLLM pinned to every CPU), or vLLM did not pin it (GPU workers, which a user may have
bound with `taskset` or NUMA binding on purpose), it does nothing.

Threads started later from the engine thread (a thread pool creates its workers lazily, at
the first jobs submitted) would inherit the engine's pinning again: `spread_threads`
remembers the CPUs it chose, and every thread pool of ours runs `join_our_cpus` as its
workers' initializer, which moves the new worker there.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_CGROUP_CPUS = "/sys/fs/cgroup/cpuset.cpus.effective"
_our_cpus: set[int] | None = None  # where spread_threads put our threads (None: nowhere)


def join_our_cpus() -> None:
    """Move the calling thread (one we start: use as a thread pool's ``initializer``) to
    the CPUs `spread_threads` chose for our threads; nothing if it chose none."""
    cpus = _our_cpus
    if cpus is None:
        return
    with contextlib.suppress(OSError):  # e.g. seccomp: stay put, as spread_threads does
        os.sched_setaffinity(0, cpus)


def process_cpus() -> set[int]:
    """The CPUs this process may run on (its cgroup's cpuset, else every CPU)."""
    try:
        with open(_CGROUP_CPUS) as f:
            return parse_cpu_list(f.read())
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> set[int]:
    """`"0-3,8,10-11"` -> {0, 1, 2, 3, 8, 10, 11} (Linux's cpu list format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    if not cpus:
        raise ValueError(f"empty cpu list {text!r}")
    return cpus


def cpus_for_our_threads() -> set[int] | None:
    """Where our threads should run: the process's CPUs the calling (engine) thread is not
    pinned to; None (leave them as they are) when it is not pinned to a subset of them."""
    if not hasattr(os, "sched_getaffinity"):
        return None  # (not Linux)
    pinned = os.sched_getaffinity(0)
    allowed = process_cpus() & set(range(os.cpu_count() or 1))
    if not allowed or pinned >= allowed:
        return None
    return allowed - pinned  # (not empty: pinned is not a superset)


@contextmanager
def spread_threads(engine_pins_threads: bool = True) -> Iterator[None]:
    """Threads started inside inherit `cpus_for_our_threads()` instead of the calling
    thread's pinning; the calling thread's own affinity is restored on exit.
    `engine_pins_threads`: whether the engine did the pinning (vLLM's CPU worker). Where it
    did not, a pinning is the user's (`taskset`, NUMA binding of a GPU worker): it is kept."""
    try:
        cpus = cpus_for_our_threads() if engine_pins_threads else None
    except OSError:
        cpus = None
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # e.g. a seccomp profile: run pinned, as before
        logger.info("kv-offload: could not move its threads off the engine's cores: %s", exc)
        yield
        return
    global _our_cpus
    _our_cpus = set(cpus)
    logger.info("kv-offload: the engine thread is pinned to CPUs %s; kv-offload's threads run "
                "on CPUs %s", sorted(before), sorted(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
