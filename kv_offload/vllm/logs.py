"""kv-offload's log lines in the engine's log, in vLLM's own format.

vLLM configures its own logger, `vllm` (its handler, its format with the process prefix and
the file and line, its level from `VLLM_LOGGING_LEVEL`), and nothing else. A library logger
without a handler of its own reaches only Python's last-resort handler, which prints
warnings and above without any format and drops INFO: the connector's start-up line, what
each rank set up and "outage ended" never showed. `adopt_vllm_logging` hands the
`kv_offload` logger (every module's logger is a child of it) vLLM's handlers and level,
once per process, and stops it from propagating, so no line is printed twice. It does
nothing where vLLM configured no logging (`VLLM_CONFIGURE_LOGGING=0`) or where the
application gave `kv_offload` a handler of its own: an operator's logging config wins.
"""

from __future__ import annotations

import logging

OUR_LOGGER = "kv_offload"


def adopt_vllm_logging() -> None:
    """Route the `kv_offload` logger through vLLM's handlers (see the module docstring)."""
    ours, theirs = logging.getLogger(OUR_LOGGER), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False
