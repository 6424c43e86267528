"""The shared tiers' background refresh (backends/refresher.py), on real threads."""

from __future__ import annotations

import threading
import time

from kv_offload.backends.common.refresher import Refresher

WAIT_S = 10.0


def test_it_refreshes_every_interval_survives_a_failed_refresh_and_stops():
    calls: list[float] = []
    third = threading.Event()

    def refresh() -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("a bug in one listing")
        if len(calls) == 3:
            third.set()

    refresher = Refresher(refresh, 0.01, name="test-refresh", what="a test store")
    assert not calls  # nothing before start()
    refresher.start()
    assert third.wait(WAIT_S), "the refreshes ended after a failed one"
    refresher.stop()
    assert refresher.stopping.is_set()
    count = len(calls)
    time.sleep(0.05)
    assert len(calls) == count  # stopped: no refresh after stop() returned
    assert not any(t.name == "test-refresh" for t in threading.enumerate())


def test_an_interval_of_zero_never_starts_a_thread():
    refresher = Refresher(lambda: None, 0, name="test-refresh-off", what="a test store")
    refresher.start()
    assert not any(t.name == "test-refresh-off" for t in threading.enumerate())
    refresher.stop()  # (nothing to join)
