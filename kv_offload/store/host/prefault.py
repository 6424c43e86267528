"""Fault the host pool's pages in ahead of use, on a background thread.

Why: plain (unpinned) host memory is committed by the OS on its first write, one page
fault per 4 KiB page, and the pool is not touched when it is allocated (`pool.py`). Every
slot's first write paid those faults inside the copy or the read that wrote it: a disk hit
in a new engine process reads into slots no one has used yet, and its O_DIRECT reads ran
at half speed (measured here: 62 reads of 256 KiB into fresh memory 27 to 59 ms with 4030
minor faults, into populated memory 15 to 26 ms; the host hit, whose slots a store had
written, never paid them). A pinned pool (GPU hosts) is resident from the start.

How: the manager hands out the lowest free slot first and reuses freed slots first, so the
fresh pages are only ever past the highest slot handed out so far (`OffloadManager.
high_water`; a store permutes pool rows only among its own slots, `slots.py`). A daemon
thread keeps the `AHEAD_BYTES` past that point populated with
`madvise(MADV_POPULATE_WRITE)` (Linux >= 5.14): the kernel faults the pages in without
changing their bytes, so it is safe beside copies into them, and ctypes releases the GIL
for the call. The memory committed stays within what is used plus `AHEAD_BYTES`. Where
madvise refuses (an older kernel, another OS), the thread ends and pages fault on first
use, as before.

When: populating is kernel work (zeroing each page) on a core the engine also wants, and
the window moves when a load stages into new slots, that is, exactly while a latency-bound
hit reads and copies (a disk hit in a new process: about 4000 faults taken beside its reads,
6 ms of its 80). So while at least a quarter of the window is still populated ahead, the
thread waits for `SETTLE_S` without a new demand before it fills the window again; below
that it fills at once, as before; a refill, once begun, fills the whole window.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import torch

from kv_offload.runtime.affinity import join_our_cpus

logger = logging.getLogger(__name__)

AHEAD_BYTES = 256 << 20  # populated past the highest slot in use: a large hit's staging
CHUNK_BYTES = 16 << 20  # one madvise call (the thread looks at `close` between calls)
SETTLE_S = 0.1  # with a quarter of the window left, refill only after this long without demand
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux >= 5.14
PAGE_BYTES = 4096


def _madvise() -> ctypes._CFuncPtr | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):  # (no libc madvise: another OS)
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


class PoolPrefaulter:
    """Populates the pages of `pool` (page-aligned, unpinned) ahead of the slots in use."""

    def __init__(self, pool: torch.Tensor, slot_bytes: int,
                 ahead_bytes: int | None = None) -> None:
        ahead_bytes = AHEAD_BYTES if ahead_bytes is None else ahead_bytes
        self._pool = pool  # (kept alive while the thread may populate its pages)
        self._base = pool.data_ptr()
        self._total = pool.numel() * pool.element_size()
        self._slot_bytes = slot_bytes
        self._ahead = ahead_bytes
        self._cond = threading.Condition()
        self._target = min(self._total, ahead_bytes)  # populate [0, target)
        self._in_use = 0  # bytes below the highest slot handed out
        self._last_demand = 0.0  # when the window last moved (time.monotonic)
        self._settle_s = SETTLE_S
        self.populated = 0  # bytes from the pool's start populated so far
        self._closed = False
        self._madvise = _madvise()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kv-offload-prefault")

    def start(self) -> None:
        if self._madvise is not None:
            self._thread.start()

    def slots_in_use_below(self, high_water: int) -> None:
        """Slots below `high_water` have been handed out: keep `ahead_bytes` past them
        populated. O(1); the caller's thread never waits for the kernel."""
        in_use = high_water * self._slot_bytes
        target = min(self._total, in_use + self._ahead)
        if target > self._target:
            with self._cond:
                self._target = max(self._target, target)
                self._in_use = max(self._in_use, in_use)
                self._last_demand = time.monotonic()
                self._cond.notify()

    def wait_until(self, nbytes: int, timeout_s: float) -> bool:
        """Tests and tools: whether the first `nbytes` got populated within `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(lambda: self.populated >= min(nbytes, self._total)
                                       or self._closed, timeout_s) and not self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join()

    def _urgent(self) -> bool:
        """Lock held: less than a quarter of the window is populated ahead of the slots in
        use (fill now, whatever runs)."""
        return self.populated - self._in_use < self._ahead // 4

    def _run(self) -> None:
        join_our_cpus()  # (off the cores vLLM pinned its forward to)
        filling = False
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._target > self.populated)
                while not (self._closed or filling or self._urgent()):
                    left = self._last_demand + self._settle_s - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)  # (a new demand restarts the wait)
                if self._closed:
                    return
                start, end = self.populated, min(self._target, self.populated + CHUNK_BYTES)
                filling = end < self._target  # a refill, once begun, fills the window
            length = -(-(end - start) // PAGE_BYTES) * PAGE_BYTES
            if self._madvise(self._base + start, length, MADV_POPULATE_WRITE) != 0:
                errno = ctypes.get_errno()
                logger.info("kv-offload: cannot fault the host tier's pages in ahead of use "
                            "(madvise errno %d); they fault on first use", errno)
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                return
            with self._cond:
                self.populated = end
                self._cond.notify_all()
