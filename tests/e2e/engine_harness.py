"""Start the real vLLM CPU engine in a child process (vllm_runner.py) and read its JSON results.

The pytest process never imports vllm: engine processes, OpenMP settings and logging stay in
the child, and a crash there fails the test with the tail of the child's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from vllm_runner import RESULT_MARKER

RUNNER = Path(__file__).with_name("vllm_runner.py")
ENGINE_BLOCK_SIZE = 32


def run_engine(
    spec: dict[str, Any],
    work_dir: Path,
    *,
    multiprocess: bool = False,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Run one engine over `spec` (see vllm_runner.py) and return its results.

    `multiprocess=False` keeps vLLM's engine core and worker inside the child process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): about 15 s per run here instead of about 45 s.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    spec_path = work_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    child_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"}
    child_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(spec_path)],
        cwd=work_dir,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    (work_dir / "engine.log").write_text(proc.stdout + proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise AssertionError(
            f"vLLM engine run failed (rc={proc.returncode}); log in {work_dir}:\n{tail}"
        )
    return json.loads(lines[-1][len(RESULT_MARKER):])


def cacheable_prefix(prompt_len: int, block_size: int = ENGINE_BLOCK_SIZE) -> int:
    """Tokens a full prefix hit can cover: whole blocks, never the last prompt token."""
    return (prompt_len - 1) // block_size * block_size


def token_ids(pass_result: dict[str, Any]) -> list[list[int]]:
    return [req["token_ids"] for req in pass_result["requests"]]
