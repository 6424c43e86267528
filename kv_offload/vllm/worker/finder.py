"""The worker's finder: asks the storage tier for keys waiting requests need, off the step path.

A tier learns what other engines store from its background refresh (a directory rescan,
Valkey's notifications and paced `SCAN`, an S3 listing), which may lag by seconds, and not
at all for this engine's scheduler while it does not step. The scheduler side knows which
keys a waiting request needs (a decode server's prompt the prefill server just stored, a
request on an idle server), and sends them in the step's metadata (`find`). This thread asks
the tier itself (`TieredStore.find_in_storage`: a stat per file, one pipelined Valkey round
trip, S3 HEADs), so the work is proportional to the request, never to the store. What the
tier holds reaches the next report like any key its refresh finds.

Its idle call (every `IDLE_CALL_S` without work) settles the key generation of an engine
that started while its storage tier was unreachable (`TieredStore.settle_generation`): the
same thread, because it is the same kind of work (bounded I/O to the store that must never
hold the engine's lock).

Own state: a queue of key lists and one daemon thread. It never takes the worker's lock: an
idle engine steps in a busy loop that takes that lock again and again, and a thread waiting
behind it answered in hundreds of milliseconds instead of one step. It names the keys from
memory (`keys_to_find`, reads only), asks the tier, and records the step it answered for;
the worker's next report takes in what the tier adopted and says so.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

from kv_offload.runtime.faults import FaultLog
from kv_offload.types import OffloadKey

MAX_QUEUED = 64  # lists of keys; past it new ones are dropped (a miss, never a stall)
IDLE_CALL_S = 2.0  # with nothing to find, the idle call runs this often


class Finder:
    """One daemon thread running `names_of` (reads only) then `find` for
    each list of keys it is given, then `found(step)` with the plan step the list came
    with (the worker moves what the tier found into its report, then says so), also when
    the list failed: the scheduler side must not wait for an answer that never comes."""

    def __init__(self, names_of: Callable[[Sequence[OffloadKey]], list[bytes]],
                 find: Callable[[Sequence[bytes]], None], found: Callable[[int], None],
                 faults: FaultLog, name: str, idle: Callable[[], None] | None = None) -> None:
        self._names_of, self._find, self._found, self._faults = names_of, find, found, faults
        self._idle = idle  # run every IDLE_CALL_S the queue stays empty (the generation)
        self._queue: queue.Queue[tuple[int, list[OffloadKey]] | None] = \
            queue.Queue(MAX_QUEUED)
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()
        self.asked = 0  # keys asked of the tier (tests, stats)

    def ask(self, step: int, keys: Sequence[OffloadKey]) -> None:
        """Queue `keys` of plan step `step` (from the step path: O(1), never blocks)."""
        if keys:
            try:
                self._queue.put_nowait((step, list(keys)))
            except queue.Full:
                self._faults.failed("find", f"{len(keys)} keys not asked: the finder is "
                                    f"{MAX_QUEUED} lists behind")

    def stop(self) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:  # (daemon thread: it ends with the process)
            return
        self._thread.join(timeout=5)

    def _next(self) -> tuple[int, list[OffloadKey]] | None:
        while True:
            try:
                return self._queue.get(timeout=IDLE_CALL_S)
            except queue.Empty:
                if self._idle is not None:
                    try:
                        self._idle()
                    except Exception as exc:
                        self._faults.failed("find", exc)

    def _run(self) -> None:
        while (item := self._next()) is not None:
            step, keys = item
            try:
                names = self._names_of(keys)
                self.asked += len(names)
                if names:
                    self._find(names)
                self._faults.succeeded("find")
            except Exception as exc:  # (a miss: the request recomputes what is not found)
                self._faults.failed("find", exc)
            try:
                self._found(step)
            except Exception as exc:
                self._faults.failed("find", exc)
