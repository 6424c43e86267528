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

from kv_offload.store.policies import LRUPolicy
from kv_offload.vllm import KVOffloadConnector

EVERY = int(os.environ.get("KV_OFFLOAD_FAULT_EVERY", "3"))
# the sides that fail (scheduler, worker, store, layer copy): all unless narrowed (debugging)
SIDES = set(os.environ.get("KV_OFFLOAD_FAULT_SIDES", "scheduler,worker,store,layer copy")
            .split(","))
RECOVERY = {"abandon_stores", "abandon_store", "fail_load", "fail_loads", "fail_layer_loads",
            "fallback_meta",
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
            if self._calls[name] % EVERY == 0 and self._side in SIDES:
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
    """Also fails every EVERY-th copy of one layer inside a layer-wise job (mid-job: the
    layers before it arrived), and counts what vLLM's per-layer hooks saw (`LAYER_HOOKS`
    line at shutdown: in-step loads started, hook calls while layer-wise loads were in
    flight, save_kv_layer calls)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hooks = Counter()
        if self._scheduler is not None:
            self._scheduler = Flaky(self._scheduler, "scheduler")

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)  # start-up: our own code, not faulted
        worker = self._worker
        with worker._lock:
            layers = worker.store.cpu.layer_copier
            if layers is not None:
                layers._copier = Flaky(layers._copier, "layer copy")
            worker.store = Flaky(worker.store, "store")
        self._worker = Flaky(worker, "worker")

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.hooks["in_step_loads"] += len(getattr(self._get_connector_metadata(), "in_step",
                                                   ()))
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.hooks["layer_waits"] += bool(self._worker.layers.loads)
        super().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        self.hooks["layer_saves"] += 1
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def shutdown(self) -> None:
        print(f"INJECTED_FAULTS {sum(INJECTED.values())} {dict(INJECTED)}", flush=True)
        if self._worker is not None:
            print(f"LAYER_HOOKS {dict(self.hooks)}", flush=True)
        super().shutdown()
