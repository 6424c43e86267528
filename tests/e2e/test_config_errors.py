"""A bad `kv_connector_extra_config` on the real vLLM 0.32 CPU engine (in vLLM's own
multiprocess mode, as operators run it): refused once, by the engine core, before any worker
opens a tier, and the cause is the last traceback an operator reads.

vLLM CPU has no hook earlier than the engine core's layout question
(`get_required_kvcache_layout`, after the weights load); on CUDA with CUDA graphs the same
check runs in the front-end process while vLLM builds its config, before any engine
process starts (`requires_piecewise_for_cudagraph`; unit-tested in
`tests/unit/vllm/test_connector_checks.py`, not run here: no GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from engine_harness import RUNNER
from test_connector import connector_config

pytestmark = pytest.mark.e2e


def test_a_bad_value_stops_the_engine_core_before_any_worker_opens_a_tier(tiny_models,
                                                                          tmp_path):
    transfer = connector_config(None)
    transfer["kv_connector_extra_config"]["cpu_bytes_to_use"] = "lots"
    spec = {"model": str(tiny_models["llama"]), "prompts": ["w1 w2"], "passes": [{}],
            "engine_args": {"kv_transfer_config": transfer}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "spec.json")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    log = proc.stdout + proc.stderr
    (tmp_path / "engine.log").write_text(log)
    assert proc.returncode != 0
    cause = "ConfigError: cpu_bytes_to_use must be a byte size"
    assert cause in log
    # Refused by the engine core while it sized the cache, not by a worker's connector.
    assert "get_required_kvcache_layout" in log
    assert "register_kv_caches" not in log and "WorkerProc hit an exception" not in log
    # After vLLM's own tracebacks, the cause is repeated as the last line we print.
    ours = [line for line in proc.stderr.splitlines() if line.startswith("kv-offload refused")]
    assert len(ours) == 1 and cause in ours[0] and ours[0].endswith("got 'lots'")
    tail = proc.stderr[proc.stderr.rindex("kv-offload refused"):]
    assert "Traceback" not in tail and "RuntimeError: Engine core initialization failed" in \
        proc.stderr[:proc.stderr.rindex("kv-offload refused")]
