"""The worker's pump thread (kv_offload/vllm/worker/pump.py), on a real thread: it polls often while
work is in flight and rarely while idle, and a wake runs a round at once."""

from __future__ import annotations

import threading
import time

from kv_offload.vllm.worker import pump as pump_module
from kv_offload.vllm.worker.pump import Pump


def count_rounds(busy: bool, seconds: float) -> int:
    rounds = []
    pump = Pump(lambda: rounds.append(1), lambda: 0, lambda: busy, "test-pump")
    pump.start()
    time.sleep(seconds)
    pump.stop()
    return len(rounds)


def test_an_idle_pump_runs_a_round_per_idle_interval_not_per_poll_interval():
    """Idle for 1 s: about 1 / IDLE_INTERVAL_S rounds (20), where polling every
    PUMP_INTERVAL_S would be ~500. (A CPU engine's forward shares its cores with this
    thread: 500 idle rounds a second cost a cold prefill ~8% here.)"""
    idle = count_rounds(busy=False, seconds=1.0)
    assert idle <= 1.0 / pump_module.IDLE_INTERVAL_S * 1.5 + 2
    assert idle >= 5  # (it still runs: the tier's key changes are taken while idle)


def test_a_busy_pump_polls_at_the_poll_interval():
    """With work in flight the pump keeps its short interval (bounded below loosely: a
    loaded machine delays wake-ups, but not to the idle pace)."""
    assert count_rounds(busy=True, seconds=1.0) > 2.0 / pump_module.IDLE_INTERVAL_S


def test_a_wake_runs_a_round_while_idle_without_waiting_out_the_interval(monkeypatch):
    """Every submission wakes the pump: with a 60 s idle interval, a wake still runs the
    next round at once (within the 10 s this allows a loaded machine)."""
    monkeypatch.setattr(pump_module, "IDLE_INTERVAL_S", 60.0)
    ran = threading.Event()
    pump = Pump(ran.set, lambda: 0, lambda: False, "test-pump")
    pump.start()
    try:
        time.sleep(0.2)
        ran.clear()  # (its first round, if any, ran before the wake)
        pump.wake()
        assert ran.wait(10.0)
    finally:
        pump.stop()


def test_a_busy_check_that_raises_keeps_the_pump_polling():
    rounds = []

    def broken() -> bool:
        raise RuntimeError("planted")

    pump = Pump(lambda: rounds.append(1), lambda: 0, broken, "test-pump")
    pump.start()
    time.sleep(0.5)
    pump.stop()
    assert len(rounds) > 0.5 / pump_module.IDLE_INTERVAL_S  # (polled as if busy)
