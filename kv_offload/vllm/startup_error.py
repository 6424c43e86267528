"""The cause of a refused start-up, repeated as the last line the operator reads.

vLLM runs our configuration checks in its engine core process (vLLM CPU has no earlier
hook). A `ConfigError` there is logged with its traceback, and then the front-end process
prints its own traceback ending in "Engine core initialization failed. See root cause
above": the cause ends up tens of lines above the end. So the engine core also leaves the
message in a small file named after the front-end process (its parent, or itself when vLLM
runs the engine in-process), and the front end, which imported this package while it built
vLLM's config, prints it at exit, after every traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import tempfile
from pathlib import Path

_PREFIX = "kv-offload-startup-error-"


def _path(pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"{_PREFIX}{pid}.txt"


def record(error: BaseException) -> None:
    """Leave `error`'s message for the front-end process (never raises)."""
    from vllm import envs

    front_end = os.getppid() if envs.VLLM_ENABLE_V1_MULTIPROCESSING else os.getpid()
    with contextlib.suppress(OSError):
        _path(front_end).write_text(f"{type(error).__name__}: {error}\n")


def _print_recorded() -> None:
    path = _path(os.getpid())
    try:
        message = path.read_text()
        path.unlink()
    except OSError:
        return
    print(f"kv-offload refused to start vLLM: {message}", end="", file=sys.stderr, flush=True)


atexit.register(_print_recorded)  # (at import: the front end imports us while it builds
# vLLM's config; the check itself costs one stat at exit)
