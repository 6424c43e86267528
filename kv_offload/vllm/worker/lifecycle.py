"""The worker's lifecycle beyond steps: vLLM's sleep mode, shutdown, and the interpreter's exit.

Sleep mode (vLLM >= 0.33) unmaps engine memory: `suspend` lets every copy out of it and
every load into it end first (bounded by `copy_timeout_s`), then loads fail and stores are
skipped until `resume`; write-through from host memory goes on. `shutdown` and
`_flush_at_exit` finish write-through (bounded by `FLUSH_TIMEOUT_S`) and never raise: a key
whose write did not finish is a miss later, never a failed shutdown.

A mixin of `OffloadWorker` (its lock, store, pump and fault log).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 30.0  # at shutdown / exit: the longest we hold the engine for write-through


class LifecycleOfWorker:
    """Sleep mode, shutdown and exit of `OffloadWorker`."""

    def suspend(self) -> None:
        """vLLM is about to unmap engine memory (sleep mode, vLLM >= 0.33): copies out of it
        end first (past `copy_timeout_s` abandoned), so do loads filling it (bounded alike);
        until `resume`, loads fail and stores are skipped. Write-through from host memory
        goes on. Idempotent."""
        with self._lock:
            self._suspended = True
        self.wait_for_engine_copies()
        with self._lock:
            if not self._drive_until(lambda: not self._loads_in_flight, self.copy_timeout_s):
                self.faults.failed("sleep", f"{self._loads_in_flight} load(s) still filling "
                                   f"engine memory after {self.copy_timeout_s} s; given up")
                for job_id, job in self._jobs.items():  # (no further copy into that memory)
                    if job.request_id is not None:
                        self.store.abandon_load(job_id)

    def resume(self) -> None:
        """Engine memory is mapped again: loads and stores run again (the tiers kept their
        KV: hits after a wake-up are served from them). Idempotent."""
        with self._lock:
            self._suspended = False

    def shutdown(self) -> None:
        """Finish write-through, then stop. Never raises."""
        if self.store is None:
            return
        if self._pump is not None:
            self._pump.stop()
        with self._lock:
            try:
                if not self.store.flush(FLUSH_TIMEOUT_S):
                    logger.warning("kv-offload rank %d: write-through did not finish before "
                                   "shutdown; unfinished keys are misses", self.rank)
                self.store.close()
            except Exception:  # never fail vLLM's shutdown: unfinished files are just misses
                logger.exception("kv-offload rank %d: shutdown of the tiers failed", self.rank)
        self.store = None

    def _flush_at_exit(self) -> None:
        """The interpreter is exiting (an offline `LLM` script ended without shutting vLLM
        down; vLLM then shuts the engine down from a finalizer, after Python has stopped
        every thread pool: the tiers could no longer write). Finish write-through now;
        vLLM's shutdown, if it comes, finds nothing left to write. Never raises."""
        with self._lock:
            if self.store is None:
                return
            try:
                if not self.store.flush(FLUSH_TIMEOUT_S):
                    logger.warning("kv-offload rank %d: write-through did not finish before "
                                   "the process exit; unfinished keys are misses", self.rank)
            except Exception:
                logger.exception("kv-offload rank %d: write-through at exit failed", self.rank)
