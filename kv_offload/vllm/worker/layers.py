"""The worker's layer-wise loads and stores: vLLM's per-layer hooks, and their safety net.

vLLM calls `wait_for_layer_load(layer)` before each attention layer's forward and
`save_kv_layer(layer)` after it (`maybe_transfer_kv_layer`). When the canonical view can be
cut per layer (`store/host/layer_copies.py`) and `layer_wise` is on:
- an **in-step load** is submitted in `start_load_kv` and copied a layer at a time, in the
  forward's layer order, on our copy threads; `start_load_kv` returns at once and
  `wait_for_layer_load(i)` waits only until layer i of every in-step load is in engine
  memory (or its load ended, failed or not), so layer i's forward runs while layers i+1..
  are still arriving;
- a **store** is submitted at the step's first `save_kv_layer` with every layer gated;
  `save_kv_layer(i)` releases layer i (the forward wrote its blocks and is done with them),
  which is copied out while later layers run; `wait_for_save` releases the rest. The job
  ends after its last layer, so a report never claims bytes not yet copied.
Asynchronous loads are not cut: their requests do not run in this step.

Failures stay recomputes. A layer that does not arrive (its copy failed, or passed
`copy_timeout_s`) fails its load: every block of it is reported by id after the forward
(`take_block_errors`) and vLLM recomputes them. A step whose forward skipped the hook of
some layer (a path that does not call it, e.g. a CUDA graph replay) may have read that
layer before it arrived: all blocks of that step's layer-wise loads are then reported too,
and the episode is logged once.

A mixin of `OffloadWorker` (its lock, jobs, store and fault log).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kv_offload.specs import KVCacheSpec
from kv_offload.store.host.layer_copies import LayerSteps, layer_cut_refusal
from kv_offload.types import GroupBlocks

logger = logging.getLogger(__name__)


class LayerWiseOfWorker:
    """Per-layer hooks of `OffloadWorker`; every method is a no-op when layer-wise is off."""

    def _init_layers(self) -> None:
        self.layer_wise = False  # set at `register`: the knob, and a view cut per layer
        self._layer_index: dict[str, int] = {}
        self._layer_loads: list = []  # this step's in-step load jobs cut per layer (Job)
        self._layers_waited: set[int] = set()
        self._store_steps: LayerSteps | None = None  # this step's store, cut per layer
        self._store_step = -1  # the plan step of `_store_steps`

    def _setup_layers(self, specs: Sequence[KVCacheSpec]) -> str:
        """At `register`: whether loads and stores go layer-wise on this rank; says which
        and why not, for the rank's one start-up line."""
        copier = self.store.cpu.layer_copier
        refusal = "turned off (layer_wise: false)" if not self.config.layer_wise else \
            layer_cut_refusal(self.canonical, specs) or \
            ("GPU copies are not cut per layer yet" if copier is None else None)
        self.layer_wise = refusal is None
        if not self.layer_wise:
            return f"whole-step loads and stores: {refusal}"
        self._layer_index = {name: i for i, name in enumerate(copier.layer_names)}
        return f"layer-wise in-step loads and stores ({len(self._layer_index)} layers)"

    def _layer_steps_for_load(self) -> LayerSteps | None:
        return LayerSteps.for_load(len(self._layer_index)) if self.layer_wise else None

    # --- vLLM's hooks ---

    def wait_for_layer(self, layer_name: str) -> None:
        """Return once `layer_name`'s bytes of every in-step load are in engine memory
        (or its load ended); past `copy_timeout_s` the stragglers are failed (recomputed)."""
        if not self._layer_loads:  # (most steps: no lock taken)
            return
        with self._lock:
            if not self._layer_loads:
                return
            layer = self._layer_index.get(layer_name)
            if layer is None:  # a name we do not cut by (e.g. a KV-sharing layer): all
                self._finish_in_step_loads()
                return
            self._layers_waited.add(layer)
            if not self._drive_until(lambda: all(job.layers.copied(layer) for job in
                                                 self._jobs.values() if job.layers is not None),
                                     self.copy_timeout_s):
                self._finish_in_step_loads(timeout_s=0.0)  # the stragglers: recomputed

    def layer_saved(self, layer_name: str, stores: GroupBlocks, step: int) -> None:
        """The forward of plan step `step` is done with `layer_name`: copy its blocks of the
        step's `stores` out now (the store is submitted, gated, at the step's first call;
        vLLM may call `start_load_kv` only after the forward)."""
        if not self.layer_wise or not stores:
            return
        layer = self._layer_index.get(layer_name)
        with self._lock:
            if self._store_steps is not None and self._store_step != step:
                self._release_layer_stores()  # (an earlier step's: its forward is over)
            self._step = step
            if self._store_steps is None:
                if self._suspended:
                    return
                steps = LayerSteps.for_store(len(self._layer_index))
                try:
                    job_id = self.store.submit_store(stores, self.store.engine_ready(), steps)
                except Exception as exc:  # skipped; wait_for_save does not submit it again
                    self.faults.failed("store submit", exc)
                    steps.open_all()
                    self._store_steps, self._store_step = steps, step
                    return
                self._jobs[job_id] = self._job(None, stores)
                self._store_steps, self._store_step = steps, step
                self._lock.notify_all()
            if layer is not None:
                self._store_steps.open(layer)
        self._pump.wake()

    def fail_layer_loads(self) -> None:
        """A recovery path: every block of this step's layer-wise loads is a load error."""
        with self._lock:
            for job in self._layer_loads:
                self._block_errors.update(job.block_ids)

    def store_layers_copied(self) -> int:
        """Layers of this step's layer-wise store copied out so far (0 without one)."""
        steps = self._store_steps
        return 0 if steps is None else steps.num_copied

    # --- the step's end ---

    def _release_layer_stores(self) -> bool:
        """Lock held, at `wait_for_save` (or the next step's start): the forward ended,
        every layer of the step's store may be copied. Whether it was already submitted."""
        steps, self._store_steps = self._store_steps, None
        if steps is None:
            return False
        steps.open_all()
        return True

    def _end_layer_loads(self) -> None:
        """Lock held, after the forward (`wait_for_save` or `get_block_ids_with_load_errors`,
        whichever vLLM calls first): finish this step's layer-wise loads; if the forward
        skipped the hook of a layer, every block of them is a load error."""
        if not self._layer_loads:
            return
        jobs, self._layer_loads = self._layer_loads, []
        waited, self._layers_waited = self._layers_waited, set()
        self._finish_in_step_loads()
        skipped = len(self._layer_index) - len(waited)
        if skipped:
            self.faults.failed("layer-wise load", f"the forward did not wait for {skipped} "
                               "layer(s); their loads are recomputed")
            for job in jobs:
                self._block_errors.update(job.block_ids)
        else:
            self.faults.succeeded("layer-wise load")
