"""Outage retries are jittered: engines that lost a server together do not probe it together."""

from __future__ import annotations

import logging
import statistics
import time

from kv_offload.backends.common.outage import MIN_JITTER, Outage


def test_engines_that_failed_together_spread_their_probes_over_the_interval():
    interval = 1.0
    outages = [Outage("server", interval, logging.getLogger("test")) for _ in range(400)]
    waits = []
    for outage in outages:
        before = time.monotonic()
        outage.failed(ConnectionError("refused"))
        waits.append(outage.retry_at - before)
    assert all(MIN_JITTER * interval <= w <= interval + 0.01 for w in waits)
    # Spread over the whole interval (uniform: quartiles near 0.33 and 0.78), not one instant.
    q1, _, q3 = statistics.quantiles(waits, n=4)
    assert 0.2 < q1 < 0.45 and 0.65 < q3 < 0.9
    assert max(waits) - min(waits) > 0.7 * interval


def test_a_burst_right_after_a_failure_still_fails_fast():
    outage = Outage("server", 1.0, logging.getLogger("test"))
    outage.failed(ConnectionError("refused"))
    assert [outage.should_try() for _ in range(100)] == [False] * 100
    assert outage.skipped == 100
