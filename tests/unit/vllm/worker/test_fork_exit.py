"""A process forked from a worker does not flush at its exit: the write-through hook at
interpreter exit belongs to the parent (the child has none of the threads a flush would wait
for, so it would wait out the whole flush timeout). The child's store records any flush call
in a marker file: behaviour, not a time bound that a loaded CI machine can break."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FORKING_SCRIPT = """
import os, sys, time
sys.path.insert(0, {tests!r})
from unit.vllm.worker.test_worker_side import Engine, block_hash, make_worker
from pathlib import Path
worker = make_worker(Engine(), Path({tmp!r}))
worker.start_stores({{0: ([block_hash(i) for i in range(6)], [1, 2, 3, 4, 5, 6])}})
start = time.monotonic()
pid = os.fork()
if pid == 0:
    def flush_in_child(timeout_s):
        Path({tmp!r}, "flushed-in-child").write_text(str(timeout_s))
        return True
    worker.store.flush = flush_in_child
    sys.exit(0)  # a normal exit: the interpreter's exit hooks run
os.waitpid(pid, 0)
print(f"child exited after {{time.monotonic() - start:.2f}} s")
"""


def test_a_child_forked_from_a_worker_exits_without_a_flush(tmp_path):
    script = FORKING_SCRIPT.format(tests=str(Path(__file__).parents[3]), tmp=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], check=True, timeout=120,
                          capture_output=True, text=True)
    assert "child exited after" in done.stdout, done.stdout + done.stderr
    assert not (tmp_path / "flushed-in-child").exists(), "the forked child ran the exit flush"
    files = list((tmp_path / "kv").rglob("*.safetensors"))
    assert len(files) == 6, f"the parent's write-through lost: {len(files)} of 6 files"
