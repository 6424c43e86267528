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

`LayerPlan` is this step's layer-wise bookkeeping, owned by the worker: which layers are cut,
the in-step loads copied per layer and the layers the forward waited for, the store's gates.
It holds no lock and no store: the worker's hooks (`wait_for_layer`, `layer_saved`) take the
worker's lock and drive the store, and ask the plan what to wait for.
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_offload.canonical import CanonicalKVCaches
from kv_offload.specs import KVCacheSpec
from kv_offload.store.host.layer_copies import LayerCopier, LayerSteps, layer_cut_refusal
from kv_offload.vllm.worker.jobs import Job


class LayerPlan:
    """Per-layer loads and stores of one rank; every query is a no-op when layer-wise is
    off (`enabled` False)."""

    def __init__(self) -> None:
        self.enabled = False  # set at `setup`: the knob, and a view cut per layer
        self._index: dict[str, int] = {}  # layer name -> its place in the forward
        self.loads: list[Job] = []  # this step's in-step load jobs cut per layer
        self._waited: set[int] = set()  # layers the forward waited for (its hook ran)
        self._store_steps: LayerSteps | None = None  # this step's store, cut per layer
        self._store_step = -1  # the plan step of `_store_steps`

    def setup(self, turned_on: bool, canonical: CanonicalKVCaches,
              specs: Sequence[KVCacheSpec], copier: LayerCopier | None) -> str:
        """At `register`: whether loads and stores go layer-wise on this rank; says which
        and why not, for the rank's one start-up line."""
        refusal = "turned off (layer_wise: false)" if not turned_on else \
            layer_cut_refusal(canonical, specs) or \
            ("GPU copies are not cut per layer yet" if copier is None else None)
        self.enabled = refusal is None
        if not self.enabled:
            return f"whole-step loads and stores: {refusal}"
        self._index = {name: i for i, name in enumerate(copier.layer_names)}
        return f"layer-wise in-step loads and stores ({len(self._index)} layers)"

    def index_of(self, layer_name: str) -> int | None:
        """The layer's place in the forward; None for a name we do not cut by (e.g. a
        KV-sharing layer)."""
        return self._index.get(layer_name)

    def steps_for_load(self) -> LayerSteps | None:
        return LayerSteps.for_load(len(self._index)) if self.enabled else None

    def waited(self, layer: int) -> None:
        self._waited.add(layer)

    def store_steps(self, step: int) -> LayerSteps | None:
        """The gates of plan step `step`'s store, if it was submitted (an earlier step's
        store is released first: its forward is over)."""
        if self._store_steps is not None and self._store_step != step:
            self.release_store()
        return self._store_steps

    def new_store(self, step: int) -> LayerSteps:
        self._store_steps = LayerSteps.for_store(len(self._index))
        self._store_step = step
        return self._store_steps

    def store_layers_copied(self) -> int:
        """Layers of this step's layer-wise store copied out so far (0 without one)."""
        steps = self._store_steps
        return 0 if steps is None else steps.num_copied

    def release_store(self) -> bool:
        """The forward ended: every layer of the step's store may be copied. Whether it
        was already submitted."""
        steps, self._store_steps = self._store_steps, None
        if steps is None:
            return False
        steps.open_all()
        return True

    def end_loads(self) -> tuple[list[Job], int]:
        """After the forward: this step's layer-wise loads, and how many layers the forward
        skipped the hook of (each such load's blocks are then load errors)."""
        jobs, self.loads = self.loads, []
        waited, self._waited = self._waited, set()
        return jobs, len(self._index) - len(waited)
