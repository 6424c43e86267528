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
from kv_offload.store.key_view import storage_key
from kv_offload.store.manager import SlotState
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
    """The read-rate probe of `TieredStore`."""

    def _init_probe(self, probe_bytes: int) -> None:
        self.probe_bytes = probe_bytes
        self._probe_state = "idle"  # -> reading -> measure -> reading ... -> done
        self._probe_next = "done"  # the state once the read in flight lands
        self._probe_after = 0.0  # no probe read starts before this (monotonic)
        self._probe_rounds = 0  # measured reads started

    def _probe_storage(self) -> None:
        """At a poll: start the next probe read if one is due (O(1) when none is; at most
        once a second, O(keys probed), while no stored key is free to probe)."""
        if self._probe_state in ("done", "reading") or self.storage is None:
            return
        warm_up = self._probe_state == "idle"
        if warm_up and (self.probe_bytes <= 0 or self.read_rate.bytes_per_s > 0):
            self._probe_state = "done"  # off, or a load's read measured the tier already
            return
        now = time.monotonic()
        if now < self._probe_after:
            return
        self._probe_after = now + RETRY_S
        wanted = 1 if warm_up else \
            min(PROBE_KEYS, max(2, self.probe_bytes // max(self.cpu.layout.group_bytes)))
        wanted = min(wanted, self.manager.num_free_slots)  # (never evicts)
        candidates = self.view.storage_sample(4 * wanted)
        keys = [k for k, state in zip(candidates, self.manager.lookup(candidates))
                if state is SlotState.ABSENT][:wanted]  # (not those in host memory too)
        plan = self.manager.prepare_store(keys) if keys else None
        if plan is None or not plan.keys:  # nothing to probe yet: asked again later
            return
        probe = Probe(plan.keys, self._generation, now)
        try:
            buffers = [self.cpu.slot_buffer(slot, key[1])
                       for key, slot in zip(plan.keys, plan.slots)]
            job = self.storage.submit_read(
                [storage_key(k, self._generation) for k in plan.keys], buffers)
        except Exception:
            self.manager.complete_store(list(plan.keys), False)
            self._probe_state = "done"  # (a tier that cannot read: its loads will say so)
            raise
        self._probe_state = "reading"
        self._probe_rounds += 0 if warm_up else 1
        self._probe_next = "done" if self._probe_rounds >= ROUNDS else "measure"
        self._probe_after = now + (0.0 if warm_up else RETRY_S)
        self._storage_jobs[job] = probe

    def _probe_done(self, probe: Probe, succeeded: Sequence[bool]) -> None:
        self._probe_state = self._probe_next  # first: a fault below must not stall it
        ok = [k for k, good in zip(probe.keys, succeeded) if good]
        bad = [k for k, good in zip(probe.keys, succeeded) if not good]
        # A load that wanted a key while the probe read it awaits this read (one read for
        # many): those keys stay, as host keys; the others' slots are freed (see above).
        awaited = {k for load in self._staged.values() for k in load.awaiting}
        kept = [k for k in ok if k in awaited]
        if kept:  # (their bytes did come from the storage tier, for those loads)
            for load in self._staged.values():
                load.from_storage += sum(k in load.awaiting for k in kept)
        self.manager.complete_store([k for k in probe.keys if k not in awaited or k in bad],
                                    False)
        self.manager.complete_store(kept, True)
        self._key_failures[Direction.LOAD] += len(bad)
        if probe.generation == self._generation:
            self.view.storage_removed(bad)  # unreadable (vanished, corrupt): not a hit
        group_bytes = self.cpu.layout.group_bytes
        self.read_rate.record(sum(group_bytes[k[1]] for k in ok),
                              time.monotonic() - probe.started)
