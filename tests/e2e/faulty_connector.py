"""A KVOffloadConnector whose insides fail on purpose, for the fault-injection e2e test.

vLLM loads it like ours (`kv_connector_module_path: "faulty_connector"`, this directory is
on the engine process's path). Every `EVERY`-th call of each method of the scheduler side,
the worker side and the tiered store raises `InjectedFault` before doing anything, and the
eviction policy raises on its own schedule: the connector must contain all of it (failed
loads recompute, stores are skipped) and vLLM must produce the same tokens as without us.
Recovery paths (what the connector calls *because* something failed) are left alone.
"""

from __future__ import annotations

import os
from collections import Counter

from kv_offload.policies import LRUPolicy
from kv_offload.vllm import KVOffloadConnector

EVERY = int(os.environ.get("KV_OFFLOAD_FAULT_EVERY", "3"))
RECOVERY = {"abandon_stores", "abandon_store", "fail_load", "fail_loads", "fallback_meta",
            "is_loading", "take_key_failures", "take_fault_counts", "usage", "shutdown"}
INJECTED = Counter()  # method -> faults raised (read back through the log line)


class InjectedFault(RuntimeError):
    pass


class Flaky:
    """Forwards to `inner`; every EVERY-th call of each public method raises instead."""

    def __init__(self, inner, side: str) -> None:
        self._inner, self._side, self._calls = inner, side, Counter()

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if name.startswith("_") or name in RECOVERY or not callable(attr):
            return attr

        def call(*args, **kwargs):
            self._calls[name] += 1
            if self._calls[name] % EVERY == 0:
                INJECTED[f"{self._side}.{name}"] += 1
                raise InjectedFault(f"injected: {self._side}.{name} call {self._calls[name]}")
            return attr(*args, **kwargs)

        return call


class RaisingPolicy(LRUPolicy):
    """A plug-in eviction policy that raises on its 2nd eviction."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.evictions = 0

    def evict(self, incoming, can_evict):
        self.evictions += 1
        if self.evictions == 2:
            raise InjectedFault("injected: eviction policy")
        return super().evict(incoming, can_evict)


class FaultyKVOffloadConnector(KVOffloadConnector):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self._scheduler is not None:
            self._scheduler = Flaky(self._scheduler, "scheduler")

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)  # start-up: our own code, not faulted
        worker = self._worker
        with worker._lock:
            worker.store = Flaky(worker.store, "store")
        self._worker = Flaky(worker, "worker")

    def shutdown(self) -> None:
        print(f"INJECTED_FAULTS {sum(INJECTED.values())} {dict(INJECTED)}", flush=True)
        super().shutdown()
