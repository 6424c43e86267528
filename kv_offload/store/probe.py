"""How `TieredStore` measures its storage tier before the first load needs it.

Whether a hit read from the storage tier may load inside the step is decided on the tier's
measured read throughput (`kv_offload.store.read_rate`), and until this rank has read something
there is no figure: the hit loads asynchronously, which costs it an extra scheduler step or
more. In a new engine process over a full disk directory (an operator restarting a node),
that was the first hit of every request stream: measured with the real vLLM CPU engine
(`benchmarks/bench_ttft.py`'s model, 2000-token prompt, 62 blocks of 256 KiB), about 84 ms
asynchronously against 60 to 65 ms for the same hit in-step a moment later.

So, once the storage tier has shown keys (its start-up inventory streams into the view) and
nothing has been read yet, the store reads a few of them into free host slots itself: first
one key (the read path's first use pays its one-time costs), then `ROUNDS` times, a second
apart, up to `probe_bytes` (and `PROBE_KEYS`) the way a load's staged read would, each a
read-rate sample (the fastest counts: vLLM's start-up work, e.g. a CPU engine's warm-up
forward, slowed a probe read beside it to a quarter of the tier's speed). Then it frees the
slots: a probe changes what the tier measured, never where a key is served from (keeping
them would make arbitrary keys host hits, and a disk hit's metrics lie), except for a key
a load asked for while the probe read it: that load awaits the probe's read, as it would
another load's, and the key stays in host memory for it. A probe only fills free slots
(never evicts), runs once per process, and not at all where no storage read loads in-step
(`in_step_read_s` or `in_step_load_bytes` 0, or a model with several KV-cache groups). A
key the tier rejects counts as in any read (the tier discards it; the view forgets it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kv_offload.config import OffloadConfig
from kv_offload.store.jobs import Probe
from kv_offload.store.loads import LoadPipeline
from kv_offload.store.manager import SlotState
from kv_offload.store.shared import JobBook, Tiers
from kv_offload.types import Direction

PROBE_BYTES = 8 << 20  # the measured probe read; about what a 16k-token hit reads per rank
PROBE_KEYS = 64  # at most this many keys (small blocks; a shared store bills requests)
ROUNDS = 3  # measured reads, RETRY_S apart: the fastest counts (start-up work slows some)
RETRY_S = 1.0  # between measured reads; and while there is nothing to probe, look again


def probe_bytes_for(config: OffloadConfig, num_groups: int) -> int:
    """An engine's probe size: 0 where no storage read can load in-step, so nothing would
    use the figure (the knobs off, or a model with several KV-cache groups)."""
    in_step = min(config.in_step_read_s, config.in_step_load_bytes) > 0 and num_groups == 1
    return PROBE_BYTES if in_step else 0


class ReadProbe:
    """The read-rate probe of a `TieredStore`: its own state machine, one read at a time."""

    def __init__(self, tiers: Tiers, book: JobBook, loads: LoadPipeline,
                 probe_bytes: int) -> None:
        self._tiers = tiers
        self._book = book
        self._loads = loads  # (a load awaiting a probed key keeps it)
        self.probe_bytes = probe_bytes
        self.state = "idle"  # -> reading -> measure -> reading ... -> done
        self._next = "done"  # the state once the read in flight lands
        self.next_at = 0.0  # no probe read starts before this (monotonic)
        self._rounds = 0  # measured reads started

    def step(self) -> None:
        """At a poll: start the next probe read if one is due (O(1) when none is; at most
        once a second, O(keys probed), while no stored key is free to probe)."""
        tiers = self._tiers
        if self.state in ("done", "reading") or tiers.storage is None:
            return
        warm_up = self.state == "idle"
        if warm_up and (self.probe_bytes <= 0 or tiers.read_rate.bytes_per_s > 0):
            self.state = "done"  # off, or a load's read measured the tier already
            return
        now = time.monotonic()
        if now < self.next_at:
            return
        self.next_at = now + RETRY_S
        manager = tiers.manager
        wanted = 1 if warm_up else \
            min(PROBE_KEYS, max(2, self.probe_bytes // max(tiers.cpu.layout.group_bytes)))
        wanted = min(wanted, manager.num_free_slots)  # (never evicts)
        candidates = tiers.view.storage_sample(4 * wanted)
        keys = [k for k, state in zip(candidates, manager.lookup(candidates))
                if state is SlotState.ABSENT][:wanted]  # (not those in host memory too)
        plan = manager.prepare_store(keys) if keys else None
        if plan is None or not plan.keys:  # nothing to probe yet: asked again later
            return
        probe = Probe(plan.keys, tiers.generation, now)
        try:
            job = tiers.read_into_slots(plan.keys, plan.slots)
        except Exception:
            manager.complete_store(list(plan.keys), False)
            self.state = "done"  # (a tier that cannot read: its loads will say so)
            raise
        self.state = "reading"
        self._rounds += 0 if warm_up else 1
        self._next = "done" if self._rounds >= ROUNDS else "measure"
        self.next_at = now + (0.0 if warm_up else RETRY_S)
        self._book.storage_jobs[job] = probe

    def done(self, probe: Probe, succeeded: Sequence[bool]) -> None:
        tiers, manager = self._tiers, self._tiers.manager
        self.state = self._next  # first: a fault below must not stall it
        ok = [k for k, good in zip(probe.keys, succeeded) if good]
        bad = [k for k, good in zip(probe.keys, succeeded) if not good]
        # A load that wanted a key while the probe read it awaits this read (one read for
        # many): those keys stay, as host keys; the others' slots are freed (see above).
        awaited = self._loads.awaited_keys()
        kept = [k for k in ok if k in awaited]
        if kept:  # (their bytes did come from the storage tier, for those loads)
            self._loads.count_from_storage(set(kept))
        manager.complete_store([k for k in probe.keys if k not in awaited or k in bad], False)
        manager.complete_store(kept, True)
        tiers.key_failures[Direction.LOAD] += len(bad)
        if probe.generation == tiers.generation:
            tiers.view.storage_removed(bad)  # unreadable (vanished, corrupt): not a hit
        group_bytes = tiers.cpu.layout.group_bytes
        tiers.read_rate.record(sum(group_bytes[k[1]] for k in ok),
                               time.monotonic() - probe.started)
