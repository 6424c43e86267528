"""Write-through at interpreter exit, in the process that started it and not in its forks.

An offline ``LLM`` script may end right after its last step without shutting vLLM down; vLLM
then shuts the engine down from a finalizer, after Python has stopped every thread pool, and
the tiers could no longer write. So the worker asks to flush when the main thread has ended,
before the pools stop. A ``fork()`` copies that hook into the child but none of the threads a
flush waits for: there it would wait out the whole flush timeout at every child's exit, so
the hook is disarmed in forked children.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

logger = logging.getLogger(__name__)


def at_interpreter_exit(flush: weakref.WeakMethod) -> None:
    """Call `flush()` (while its object lives) when the main thread has ended, before Python
    stops the thread pools our tiers write with. `atexit` runs too late for that; the
    hook `concurrent.futures` itself uses does not (hooks run last-registered first)."""
    armed = [True]
    os.register_at_fork(after_in_child=lambda: armed.__setitem__(0, False))

    def hook() -> None:
        if armed[0] and (method := flush()) is not None:
            method()

    try:
        threading._register_atexit(hook)  # (CPython >= 3.9; private, stable since)
    except (AttributeError, RuntimeError):  # another Python, or already exiting
        logger.debug("kv-offload: no write-through at interpreter exit", exc_info=True)
