"""How fast this rank reads from its storage tier, as measured on its own reads.

Each storage read that lands gives one sample: the bytes it put in host slots over the time
from its submission to its result. The figure is the fastest of the last `WINDOW` samples:
a sample also counts whatever delayed the read's result being taken (the tier's first use,
a pump thread that yields to the engine while an asynchronous read lands, other jobs on the
machine), which only ever makes a read look slower than the tier is; the fastest recent read
is what the tier has just shown it can do, and a tier that slows down for good shows it
within `WINDOW` reads. Measured with a real engine over a local disk (`bench_ttft.py`, one
new process, 16 MiB reads): the first read took 3 s (5 MB/s), later asynchronous ones ran at
100 to 600 MB/s.

The workers report the figure and the scheduler side uses it to decide whether a hit read
from the storage tier is quick enough to load inside the step
(`kv_offload.vllm.scheduler.in_step_loads`).
Until the first read lands the rate is unknown (0) and such hits load asynchronously; a new
store whose storage tier already holds keys measures it with a probe read before any load
needs it (`kv_offload.store.probe`), so even the first hit after a restart can load in-step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW = 8  # recent reads the figure is taken from


@dataclass
class ReadRate:
    """Measured storage read throughput of one rank (bytes per second; 0: not measured)."""

    samples: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    @property
    def bytes_per_s(self) -> float:
        return max(self.samples, default=0.0)

    def record(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0:
            self.samples.append(num_bytes / max(seconds, 1e-6))
