"""A process forked from a worker exits at once: the write-through hook at interpreter exit
belongs to the parent (the child has none of the threads a flush would wait for)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FORKING_SCRIPT = """
import os, sys, time
sys.path.insert(0, {tests!r})
from test_vllm_worker_side import Engine, block_hash, make_worker
from pathlib import Path
worker = make_worker(Engine(), Path({tmp!r}))
worker.start_stores({{0: ([block_hash(i) for i in range(6)], [1, 2, 3, 4, 5, 6])}})
start = time.monotonic()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: the interpreter's exit hooks run
os.waitpid(pid, 0)
print(f"child exited after {{time.monotonic() - start:.2f}} s")
"""


def test_a_child_forked_from_a_worker_exits_without_waiting_for_a_flush(tmp_path):
    script = FORKING_SCRIPT.format(tests=str(Path(__file__).parent), tmp=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], check=True, timeout=120,
                          capture_output=True, text=True)
    seconds = float(done.stdout.split("after ")[1].split(" s")[0])
    assert seconds < 5.0, f"the forked child took {seconds:.1f} s to exit"
    files = list((tmp_path / "kv").rglob("*.safetensors"))
    assert len(files) == 6, f"the parent's write-through lost: {len(files)} of 6 files"
