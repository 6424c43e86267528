"""How fast this rank reads from its storage tier, as measured on its own reads.

Each storage read that lands gives one sample: the bytes it put in host slots over the time
from its submission to its result (queueing in the tier and its I/O threads included, so the
figure is what a load waits, not the device's peak). `ReadRate` keeps an exponentially
weighted mean of those samples; the workers report it, and the scheduler side uses it to
decide whether a hit read from the storage tier is quick enough to load inside the step
(`kv_offload.vllm.in_step_loads`). Until the first read lands the rate is unknown (0):
such hits load asynchronously, and the first one measures the tier.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.3  # weight of the newest sample: follows a tier that slows down within a few


@dataclass
class ReadRate:
    """Measured storage read throughput of one rank (bytes per second; 0: not measured)."""

    bytes_per_s: float = 0.0

    def record(self, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0:
            return
        sample = num_bytes / max(seconds, 1e-6)
        self.bytes_per_s = sample if not self.bytes_per_s else \
            SMOOTHING * sample + (1 - SMOOTHING) * self.bytes_per_s
