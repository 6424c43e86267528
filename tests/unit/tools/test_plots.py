"""`--plot PATH`: the benchmarks' figures are real PNGs drawn from their JSON.

`kv-offload bench` draws its figure from a tiny real run; the vLLM benchmarks' figures are
drawn (through `python -m kv_offload.tools.plots`, what their `--plot` calls) from small
documents shaped as those benchmarks write them. Without matplotlib, `--plot` is refused
before anything runs, naming the extra to install.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from unit.tools.test_cli import REPO, kv_offload_cli

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """Width and height of a PNG, after checking it decodes as one."""
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    pixels = matplotlib.image.imread(path)  # decodes every row: a truncated file fails
    width, height = struct.unpack(">II", data[16:24])
    assert pixels.shape[:2] == (height, width)
    return width, height


def test_bench_plot_draws_tier_throughput_next_to_its_json(tmp_path):
    proc = kv_offload_cli("bench", "--tier", "filesystem", "--fs-root", str(tmp_path / "fs"),
                          "--page-kib", "64", "128", "--connections", "1", "2",
                          "--total-mib", "0.5", "--repeats", "1",
                          "--json", str(tmp_path / "tiers.json"),
                          "--plot", str(tmp_path / "tiers.png"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    width, height = png_size(tmp_path / "tiers.png")
    assert width > 500 and height > 300
    assert json.loads((tmp_path / "tiers.json").read_text())["command"] == "bench"


def _ttft(arch: str) -> dict:
    passes = {name: {"median_ttft_wall_s": s} for name, s in [
        ("cold_no_connector", 1.3), ("vllm_hit", 0.03), ("cold_with_connector", 1.35),
        ("host", 0.045), ("disk", 0.25)]}
    return {"model": {"arch": arch}, "num_prompts": 3, "prompt_tokens": 2000, "passes": passes}


def _zipf(fraction: float, served: int) -> dict:
    return {"sizes": {"disk_fraction": fraction, "disk_blocks": int(1000 * fraction),
                      "fs_bytes_to_use": int(1000 * fraction) * 70_000},
            "served_tokens": served, "ideal_disk_tokens": served + 100,
            "ideal_host_tokens": 300}


def _steps(keys: int) -> dict:
    samples = {side: [0.1 + 0.01 * i + keys * 1e-7 for i in range(50)]
               for side in ("scheduler", "worker", "ipc")}
    return {"steps": {"keys": keys, "stored_keys": max(keys, 4000),
                      "steady_state": {"samples_ms": samples}}}


@pytest.mark.parametrize("kind, documents", [
    ("ttft", [_ttft("llama"), _ttft("qwen3_next")]),
    ("zipf", [{"runs": [_zipf(0.25, 900), _zipf(0.5, 1500), _zipf(0.75, 1800)]}]),
    ("step-cost", [{"meta": {}, "results": [_steps(0), _steps(1_000_000)]}]),
])
def test_a_benchmark_figure_is_drawn_from_its_json(kind, documents, tmp_path):
    paths = []
    for i, doc in enumerate(documents):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(doc))
    out = tmp_path / f"{kind}.png"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    subprocess.run([sys.executable, "-m", "kv_offload.tools.plots", kind, *map(str, paths),
                    "-o", str(out)], check=True, cwd=tmp_path, env=env, timeout=120)
    width, height = png_size(out)
    assert width > 400 and height > 300


def test_plot_without_matplotlib_is_refused_before_the_run_naming_the_extra(tmp_path):
    hidden = tmp_path / "no_matplotlib"
    (hidden / "matplotlib").mkdir(parents=True)
    (hidden / "matplotlib" / "__init__.py").write_text(
        "raise ImportError('No module named matplotlib')\n")
    proc = kv_offload_cli("bench", "--tier", "filesystem", "--fs-root", str(tmp_path / "fs"),
                          "--plot", str(tmp_path / "x.png"), cwd=tmp_path, extra_path=hidden,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--plot needs matplotlib: pip install 'kv-offload[plots]'" in proc.stderr
    assert not (tmp_path / "fs").exists()  # nothing ran
