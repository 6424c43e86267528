"""Write-through at interpreter exit: a hook that runs before Python stops thread pools.

An offline `LLM` script may end without shutting vLLM down; vLLM then shuts the engine down
from a finalizer, after Python has stopped every thread pool, when our tiers could no
longer write. The hook below runs earlier, while the pools still work.
"""

from __future__ import annotations

import logging
import threading
import weakref

logger = logging.getLogger(__name__)


def at_interpreter_exit(flush: weakref.WeakMethod) -> None:
    """Call `flush()` (while the worker lives) when the main thread has ended, before Python
    stops the thread pools our tiers write with. `atexit` runs too late for that; the
    hook `concurrent.futures` itself uses does not (hooks run last-registered first)."""
    def hook() -> None:
        if (method := flush()) is not None:
            method()

    try:
        threading._register_atexit(hook)  # (CPython >= 3.9; private, stable since)
    except (AttributeError, RuntimeError):  # another Python, or already exiting
        logger.debug("kv-offload: no write-through at interpreter exit", exc_info=True)
