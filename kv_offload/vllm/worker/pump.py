"""The worker's pump: the thread that advances a rank's copies while the engine runs.

The engine's thread only records what to do (and, on a GPU, an event on its stream); the
pump stages the copies and drains results, while a forward runs, and keeps write-through
going while the engine is idle. Each round calls `round_fn` (the worker's, under its lock).

From a forward's end (`forward_ended`: vLLM's `wait_for_save`, after the step's async
`start_load_kv`) to the next step's start (`step_started`) vLLM schedules: the pump leaves
it the lock and the GIL, but never for longer than `YIELD_TO_ENGINE_S` since its own last
round, and not at all while a load is in flight (else an engine stepping without a forward,
its request waiting for our load, would starve it).

While nothing is in flight (`busy` false: no job of the worker's, nothing the store's `poll`
advances) the pump sleeps `IDLE_INTERVAL_S` instead of `PUMP_INTERVAL_S`, and every
submission wakes it. Why: a round takes the GIL and a core; 500 idle rounds a second cost a
CPU engine's forward (on the cores its OpenMP threads share) 0.8 to 1.4 s of a 17 s cold
prefill here, about 8% of its time to first token (`benchmarks/bench_ttft.py`'s
cold_with_connector against cold_no_connector).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

PUMP_INTERVAL_S = 0.002
IDLE_INTERVAL_S = 0.05  # nothing in flight: a round only takes the tier's key changes
YIELD_TO_ENGINE_S = 0.02  # the pump runs at least this often while vLLM schedules


class Pump:
    """One daemon thread calling `round_fn()` every `PUMP_INTERVAL_S` while `busy()` (else
    every `IDLE_INTERVAL_S`) or when woken, except while it yields to the engine's
    scheduling."""

    def __init__(self, round_fn: Callable[[], None], loads_in_flight: Callable[[], int],
                 busy: Callable[[], bool], name: str) -> None:
        self._round, self._loads_in_flight, self._busy = round_fn, loads_in_flight, busy
        self._stop = threading.Event()
        self._wake = threading.Event()  # new work
        self._forward_ended: float | None = None  # the engine is between two forwards
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def wake(self) -> None:
        self._wake.set()

    def step_started(self) -> None:
        """A step's execution begins: the engine stops scheduling, run freely again."""
        self._forward_ended = None
        self._wake.set()

    def forward_ended(self) -> None:
        """The step's forward is over: vLLM now schedules the next step."""
        self._forward_ended = time.monotonic()

    def stop(self) -> None:
        """End the thread after its current round (joins it)."""
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join()

    def _run(self) -> None:
        """Nothing can end this loop but `stop`: `round_fn` contains its own faults."""
        last_round = 0.0
        while not self._stop.is_set():
            try:  # (read without the worker's lock: a stale answer costs one interval,
                busy = self._busy()  # and every submission wakes the pump anyway)
            except Exception:  # (a fault is the round's to contain: just poll often)
                busy = True
            self._wake.wait(PUMP_INTERVAL_S if busy else IDLE_INTERVAL_S)
            self._wake.clear()
            now, ended = time.monotonic(), self._forward_ended
            if not self._loads_in_flight() and ended is not None and \
                    now - ended < YIELD_TO_ENGINE_S and now - last_round < YIELD_TO_ENGINE_S:
                continue  # the engine is scheduling its next step: leave it the CPU
            last_round = now
            self._round()
