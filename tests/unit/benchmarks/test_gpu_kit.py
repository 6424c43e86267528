"""The GPU kit's CPU side (benchmarks/gpu/): planning transfers under the per-command limit,
the checksums manifest, reassembly and install on the GPU side, and the runner's time bounds.

prepare.py and unpack.py run here as their users run them (child processes), on a small
fake vLLM wheel and fake wheels, with a transfer limit of a few KiB so that files are cut
across transfers; no network. The real wheel's preparation is docs/gpu-kit.md's business.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))
from kit_parts import plan_transfers  # noqa: E402

LIB = os.urandom(40_000)  # (random: gzip cannot shrink it below a transfer)


def _run(script: str, *args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GPU / script), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def _fake_vllm_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/__init__.py", "__version__ = '0.32.0'\n")
        z.writestr("vllm/platforms/cuda.py", "import vllm._C_stable_libtorch\n")
        z.writestr("vllm/_C_stable_libtorch.abi3.so", LIB)
        z.writestr("vllm/fs_io_C.abi3.so", b"small library that travels")
        z.writestr("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", b"x" * 5000)
        z.writestr("vllm/vllm_flash_attn/__init__.py", "")
        z.writestr("vllm/third_party/deep_gemm/include/a.hpp", "// header")
        z.writestr("vllm/vllm-rs", b"binary")
        z.writestr("vllm-0.32.0.dist-info/METADATA",
                   "Name: vllm\nVersion: 0.32.0\nRequires-Dist: pydantic>=2.12.0\n"
                   "Requires-Dist: torch==2.13.0\nRequires-Dist: ray; extra == 'ray'\n"
                   "Requires-Dist: brand-new-dependency>=1\n")
    return path


def _fake_wheels(folder: Path) -> Path:
    folder.mkdir()
    with zipfile.ZipFile(folder / "pydantic-2.14.4-py3-none-any.whl", "w") as z:
        z.writestr("pydantic/__init__.py", "VERSION = '2.14.4'\n")
        z.writestr("pydantic-2.14.4.dist-info/METADATA", "Name: pydantic\n")
    with zipfile.ZipFile(folder / "blake3-1.0-cp312-cp312-manylinux_2_17_x86_64.whl", "w") as z:
        z.writestr("blake3-1.0.data/platlib/blake3.py", "HASH = 3\n")
        z.writestr("blake3-1.0.dist-info/METADATA", "Name: blake3\n")
    return folder


@pytest.fixture
def prepared(tmp_path) -> Path:
    out = tmp_path / "prepared"
    proc = _run("prepare.py", "--wheel", _fake_vllm_wheel(tmp_path / "vllm-0.32.0-x.whl"),
                "--wheels-dir", _fake_wheels(tmp_path / "wheels"), "--out", out,
                "--transfer-mib", 30_000 / 2**20, "--tree-mib", 0, "--margin-mib", 0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "brand-new-dependency" in proc.stderr  # (a requirement the kit cannot place)
    return out


def test_transfers_are_filled_in_order_and_a_file_is_cut_where_one_is_full():
    plan = plan_transfers([("a", 25), ("b", 40), ("c", 0)], capacity=30)
    assert [[(p.name, p.offset, p.size) for p in t] for t in plan] == [
        [("a.part01", 0, 25), ("b.part01", 0, 5)],
        [("b.part02", 5, 30)],
        [("b.part03", 35, 5), ("c.part01", 0, 0)]]
    assert [p.transfer for t in plan for p in t] == [
        "transfer-1", "transfer-1", "transfer-2", "transfer-3", "transfer-3"]


def test_prepare_cuts_the_payload_into_transfers_under_the_limit_with_a_manifest(prepared):
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert len(manifest["transfers"]) >= 2
    for transfer in manifest["transfers"]:
        folder = prepared / transfer["name"]
        parts = [p for p in folder.iterdir() if p.name != "manifest.json"]
        assert sum(p.stat().st_size for p in parts) == transfer["bytes"] <= 30_000
        assert json.loads((folder / "manifest.json").read_text()) == manifest
    lib = next(f for f in manifest["files"] if f["name"] == "vllm-lib.so.gz")
    assert lib["install"] == {"kind": "gzip", "to": "vllm/_C_stable_libtorch.abi3.so"}
    assert len(lib["parts"]) >= 2  # (cut across transfers)
    assert manifest["requirements"] == {"kit": ["pydantic"], "image": ["torch"],
                                        "left_out": [], "unplaced": ["brand-new-dependency"]}
    assert manifest["slim"]["dropped_files"] == 3  # flash-attention, a header, vllm-rs


def test_unpack_stages_each_transfer_then_joins_checks_and_installs(prepared, tmp_path):
    stage, site = tmp_path / "stage", tmp_path / "site"
    transfers = sorted(prepared.glob("transfer-*"))
    for transfer in transfers[:-1]:  # one command per transfer, as on the GPU machine
        proc = _run("unpack.py", "--stage", stage, transfer)
        assert proc.returncode == 0, proc.stderr
    proc = _run("unpack.py", "--stage", stage, "--install", site, transfers[-1])
    assert proc.returncode == 0, proc.stderr
    assert (site / "vllm/_C_stable_libtorch.abi3.so").read_bytes() == LIB
    assert (site / "vllm/fs_io_C.abi3.so").exists()
    assert (site / "vllm/__init__.py").read_text() == "__version__ = '0.32.0'\n"
    assert (site / "vllm-0.32.0.dist-info/METADATA").exists()
    assert not (site / "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so").exists()
    assert not (site / "vllm/vllm-rs").exists()
    assert not list(site.rglob("*.hpp"))
    assert (site / "pydantic/__init__.py").exists() and (site / "blake3.py").exists()
    assert not list(site.glob("*.data"))  # (a wheel's platlib lands in the site itself)
    check = subprocess.run([sys.executable, "-c", "import pydantic, blake3, vllm; "
                            "print(pydantic.VERSION, blake3.HASH, vllm.__version__)"],
                           cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
                           capture_output=True, text=True)
    assert check.stdout.split() == ["2.14.4", "3", "0.32.0"], check.stderr


def test_a_damaged_part_is_named_with_the_transfer_to_send_again(prepared, tmp_path):
    part = next((prepared / "transfer-1").glob("*.part*"))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    proc = _run("unpack.py", "--stage", tmp_path / "stage", prepared / "transfer-1")
    assert proc.returncode == 2
    assert f"{part.name} in" in proc.stderr and "send transfer-1 again" in proc.stderr


def test_installing_before_every_transfer_arrived_names_the_missing_ones(prepared, tmp_path):
    proc = _run("unpack.py", "--stage", tmp_path / "stage", "--install", tmp_path / "site",
                prepared / "transfer-1")
    assert proc.returncode == 2
    assert "send transfer-2" in proc.stderr and not (tmp_path / "site" / "vllm").exists()


def test_the_plan_needs_no_network_and_names_the_exact_wheel_and_platform(tmp_path):
    proc = _run("prepare.py", "--plan", "--out", tmp_path / "p", "--tree-mib", 4)
    assert proc.returncode == 0, proc.stderr
    assert "vllm==0.32.0" in proc.stdout and "--python-version 3.12" in proc.stdout
    assert "--platform manylinux_2_28_x86_64" in proc.stdout
    assert "pydantic==2.14.4" in proc.stdout
    assert not (tmp_path / "p").exists()  # (writes nothing)


def test_a_step_past_its_bound_is_killed_and_the_next_steps_say_why_they_did_not_run(
        tmp_path):
    """The runner's time bounds, without vLLM: the preflight cannot import torch and vLLM
    in 0.01 s, so it is killed; the steps after it are skipped, and the JSON says so."""
    out = tmp_path / "out"
    proc = _run("run_on_gpu.py", "--device", "cpu", "--tiny", "--out", out,
                "--bound", "preflight=0.01", "--steps", "preflight,correctness")
    assert proc.returncode == 1
    results = json.loads((out / "results.json").read_text())
    assert results["steps"]["preflight"]["status"] == "timed_out"
    assert "past its bound" in results["steps"]["preflight"]["error"]
    assert results["steps"]["correctness"] == {"status": "skipped",
                                               "reason": "the preflight did not pass"}
    assert results["summary"]["status"] == {"preflight": "timed_out", "correctness": "skipped"}
    assert (out / "run.log").exists()


def test_a_step_with_under_half_its_bound_left_of_the_budget_is_skipped(tmp_path):
    out = tmp_path / "out"
    proc = _run("run_on_gpu.py", "--device", "cpu", "--tiny", "--out", out,
                "--budget-s", "10", "--steps", "preflight")
    assert proc.returncode == 0, proc.stderr  # (skipped is not failed)
    step = json.loads((out / "results.json").read_text())["steps"]["preflight"]
    assert step["status"] == "skipped" and "under half its bound (120 s)" in step["reason"]
