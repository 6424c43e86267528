"""Copies cut per layer, so that the engine's forward and our copies overlap.

vLLM calls the connector around every attention layer's forward (`wait_for_layer_load`
before, `save_kv_layer` after). A load cut per layer lets the forward of layer i run while
layers i+1.. are still being copied in; a store cut per layer copies layer i out as soon as
the forward is done with it, before the whole forward ends.

A job cut per layer carries a `LayerSteps`, the handshake between the engine's thread and
the copy thread, per layer in the forward's order:
- **gates** (stores): the copy thread copies layer i only once the engine opened gate i
  (`save_kv_layer`: the forward wrote that layer's blocks and will not touch them again in
  this step); a load's gates are open from the start;
- **progress** (loads): after copying layer i the copy thread marks it copied; the engine's
  `wait_for_layer_load(i)` returns once it is (or once the whole job ended, failed or not).
A layer is copied whole (every block of the job) before the next one starts, so a layer
marked copied holds every byte of the job. The job itself still ends once, with one result,
after its last layer: nothing claims a store's bytes before they were all copied.

The cut needs the canonical view to give every layer its own bytes: one cache group, of
attention layers (Mamba layers do not call the hooks), one ref per layer name, no two refs
sharing bytes (`layer_cut_refusal`). Otherwise, and for GPU engine memory (whose copies run
on streams, not yet cut per layer), jobs run whole as before and the connector waits for a
whole load before the forward, and copies stores after it.

The copy order is the group's layer order, which for vLLM is the order the layers were
built in, i.e. the forward's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kv_offload.canonical import CanonicalKVCaches
from kv_offload.kernels.cpu import CpuCopier
from kv_offload.kernels.geometry import HostSlotLayout, build_segments
from kv_offload.kernels.plan import CopyPlan, GroupPlan
from kv_offload.specs import KVCacheSpec, MambaSpec


class LayerSteps:
    """The per-layer handshake of one job (thread-safe)."""

    def __init__(self, num_layers: int, *, gated: bool) -> None:
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._open = [not gated] * num_layers
        self._copied = 0  # layers copied, in order

    @classmethod
    def for_load(cls, num_layers: int) -> LayerSteps:
        return cls(num_layers, gated=False)

    @classmethod
    def for_store(cls, num_layers: int) -> LayerSteps:
        return cls(num_layers, gated=True)

    # --- the engine's side ---

    def open(self, layer: int) -> None:
        """The forward is done with `layer`: its blocks may be copied out."""
        with self._cond:
            self._open[layer] = True
            self._cond.notify_all()

    def open_all(self) -> None:
        """The forward ended (or the layers are unknown): every layer may be copied."""
        with self._cond:
            self._open = [True] * self.num_layers
            self._cond.notify_all()

    def copied(self, layer: int) -> bool:
        """Whether every block of `layer` has been copied."""
        return layer < self._copied

    @property
    def num_copied(self) -> int:
        """Layers copied so far (they are copied in order)."""
        return self._copied

    # --- the copy thread's side ---

    def wait_open(self, layer: int, timeout_s: float) -> bool:
        """Wait until gate `layer` opened; False past `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._open[layer]:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def mark_copied(self, layer: int) -> None:
        with self._cond:
            self._copied = max(self._copied, layer + 1)


def layer_cut_refusal(canonical: CanonicalKVCaches,
                      specs: Sequence[KVCacheSpec] | None = None) -> str | None:
    """Why copies of this view (of groups with these specs, if given) cannot be cut per
    layer; None: they can."""
    if len(canonical.group_refs) != 1:
        return "several KV-cache groups (groups may overlay the same bytes)"
    if specs is not None and any(isinstance(spec, MambaSpec) for spec in specs):
        return "Mamba-type layers (vLLM calls no per-layer hook for them)"
    refs = canonical.group_refs[0]
    names = [ref.layer_name for ref in refs]
    if len(set(names)) != len(names):
        return "a layer with several pieces of bytes"
    spans: dict[int, list[tuple[int, int]]] = {}
    for ref in refs:
        spans.setdefault(ref.tensor_idx, []).append(
            (ref.offset_bytes, ref.offset_bytes + ref.page_size_bytes))
    for pieces in spans.values():
        pieces.sort()
        if any(a[1] > b[0] for a, b in zip(pieces, pieces[1:])):
            return "layers sharing bytes"
    return None


class LayerCopier:
    """Moves one group's `CopyPlan` a layer at a time (CPU engine memory)."""

    def __init__(self, canonical: CanonicalKVCaches, pool, layout: HostSlotLayout) -> None:
        segments = build_segments(canonical, layout, pool, fuse=False)[0]
        refs = canonical.group_refs[0]
        self.layer_names = tuple(refs[s.refs[0]].layer_name for s in segments)
        self._bytes = [refs[s.refs[0]].page_size_bytes for s in segments]
        # one "group" per layer: a layer's plan is the job's pairs under that layer's index
        self._copier = CpuCopier([[segment] for segment in segments])

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def copy(self, plan: CopyPlan, steps: LayerSteps, gate_timeout_s: float,
             timeout_s: float | None = None, cancelled: threading.Event | None = None) -> int:
        """Copy `plan` layer by layer (gates and progress in `steps`); the bytes moved.
        Raises TimeoutError if a gate stays closed past `gate_timeout_s`, `CopyOverrun`
        if a layer's copy outlives `timeout_s`, and stops before the next layer once
        `cancelled` is set (the caller gave the job up)."""
        pairs = plan.groups[0] if plan.groups else None
        for layer in range(self.num_layers):
            if not steps.wait_open(layer, gate_timeout_s):
                raise TimeoutError(f"layer {self.layer_names[layer]} was not released by the "
                                   f"forward within {gate_timeout_s} s")
            if cancelled is not None and cancelled.is_set():
                raise TimeoutError(f"the copy was cancelled by its caller before layer "
                                   f"{self.layer_names[layer]}")
            if pairs is not None:
                self._copier.copy(CopyPlan(plan.direction, (
                    GroupPlan(layer, pairs.src, pairs.dst),),
                    pairs.num_pairs * self._bytes[layer]), timeout_s=timeout_s,
                    cancelled=cancelled)
            steps.mark_copied(layer)
        return plan.num_bytes

    def close(self) -> None:
        self._copier.close()
