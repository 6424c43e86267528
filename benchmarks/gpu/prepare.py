"""On a CPU machine with network: prepare what vLLM needs on the GPU machine (issue 49).

    python benchmarks/gpu/prepare.py                   # download, slim, split, checksum
    python benchmarks/gpu/prepare.py --plan            # say what it would do; no network
    python benchmarks/gpu/prepare.py --wheel W.whl --wheels-dir DIR   # offline, from files

Why: the lent H200 has torch 2.11+cu130 but no vLLM, no network and no package index, and a
command brings at most 64 MiB of files (project tree included). vLLM 0.32.0's CUDA wheel is
326.5 MB; what an offline `LLM` with eager Triton attention needs of it is much less: its
Python sources, its metadata and a few small libraries (a tar.xz), and
`_C_stable_libtorch.abi3.so` (gzipped; vLLM's CUDA platform imports it unconditionally),
plus about 30 small wheels the GPU image lacks (docs/gpu-kit.md has the study behind
these lists). Everything goes into an ignored folder (default benchmarks/gpu/prepared/):

  downloads/      the vLLM wheel and the missing wheels, as pip downloaded them
  payload/        vllm-src.tar.xz, vllm-lib.so.gz and the wheels: what must travel
  transfer-N/     the payload cut into parts, each folder under the per-command limit once
                  the project tree is counted, with manifest.json (sha256 of every part and
                  every whole file, and how benchmarks/gpu/unpack.py installs each)

Nothing of vLLM is committed. It also reads the wheel's Requires-Dist and says which
requirement the kit ships, which the GPU image has, which are left out on purpose and which
it cannot place (a new requirement of the release: look before the GPU run).
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kit_parts import save_manifest, write_transfers  # noqa: E402

VLLM_VERSION = "0.32.0"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_OUT = HERE / "prepared"
# The GPU machine: CPython 3.12.3 on x86-64 Linux (Ubuntu 24.04's Python: glibc 2.39), so
# manylinux wheels up to glibc 2.35 (llguidance 1.7.6 has only manylinux_2_31 wheels).
PIP_TARGET = ["--no-deps", "--only-binary=:all:", "--python-version", "3.12",
              *(arg for tag in ("2_35", "2_34", "2_31", "2_28", "2_17")
                for arg in ("--platform", f"manylinux_{tag}_x86_64")),
              "--platform", "manylinux2014_x86_64"]
# The library vLLM's CUDA platform imports unconditionally (travels gzipped, apart).
MAIN_LIB = "vllm/_C_stable_libtorch.abi3.so"
# The other compiled files that travel (small); every other .so and `vllm-rs` stay behind:
# flash-attention (eager Triton attention instead), MoE, deep_gemm, flashmla, qutlass.
SMALL_LIBS = {"vllm/cumem_allocator.abi3.so", "vllm/fs_io_C.abi3.so", "vllm/spinloop.abi3.so"}
DROPPED_SUFFIXES = (".so", ".h", ".hpp", ".cuh", ".cu", ".a")
DROPPED_FILES = {"vllm/vllm-rs"}
# What the GPU image lacks for vLLM's offline engine path (the study of 2026-12-01: hard
# imports, then imports at run time). A version where the study pinned one; the others take
# vLLM's own specifier from its Requires-Dist when it has one.
KIT_WHEELS = {
    "pydantic": "==2.14.4", "pydantic-core": "==2.50.5", "annotated-types": "==0.8.0",
    "typing-inspection": "==0.4.5", "msgspec": "==0.23.0", "pyzmq": "==27.3.0",
    "cbor2": "==6.3.0", "pybase64": "==1.5.1", "cachetools": "==8.0.2",
    "mistral-common": "==1.13.1", "openai": "==3.57.0", "sniffio": "==1.3.1",
    "oss-harmony": "==0.0.11", "xgrammar": "==0.2.8", "apache-tvm-ffi": "==0.1.11",
    "llguidance": "==1.7.6", "fastapi": "==0.136.3", "starlette": "==1.10.0",
    "partial-json-parser": "==0.2.1.1.post7",
    "blake3": "", "setproctitle": "", "jiter": "", "distro": "", "depyf": "", "astor": "",
    "dill": "", "python-json-logger": "", "ijson": "", "orjson": ""}
# On the GPU image (the study), with what those bring (transformers, huggingface-hub, numba).
IMAGE = {"torch", "triton", "cupy-cuda13x", "cuda-bindings", "transformers", "tokenizers",
         "huggingface-hub", "safetensors", "xxhash", "numpy", "numba", "cloudpickle", "uvloop",
         "msgpack", "prometheus-client", "psutil", "sentencepiece", "tiktoken", "pytest",
         "regex", "requests", "tqdm", "pyyaml", "filelock", "typing-extensions", "setuptools",
         "protobuf", "six"}
# Requirements an offline `LLM` (no server, no MoE, no vision, eager) does not import.
LEFT_OUT = {"ray", "flashinfer-python", "xformers", "outlines-core", "pycountry",
            "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "tilelang",
            "nvidia-cudnn-frontend", "nvtx", "fastsafetensors", "instanttensor",
            "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla", "humming-kernels",
            "aiohttp", "pillow", "prometheus-fastapi-instrumentator", "lm-format-enforcer",
            "lark", "jsonschema", "opencv-python-headless", "einops", "compressed-tensors",
            "watchfiles", "ninja", "anthropic", "model-hosting-container-standards", "mcp",
            "opentelemetry-sdk", "opentelemetry-api", "opentelemetry-exporter-otlp",
            "opentelemetry-semantic-conventions-ai", "py-cpuinfo"}


class PrepareError(RuntimeError):
    """A preparation step failed; the message says what to do."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(wheel: Path) -> dict[str, str]:
    """vLLM's unconditional Requires-Dist (name -> specifier), read from the wheel."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    found = {}
    for line in lines:
        if not line.startswith("Requires-Dist:") or "extra ==" in line:
            continue
        spec = line.split(":", 1)[1].split(";", 1)[0].strip()
        match = re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)", spec)
        if match:
            found[canonical(match.group(1))] = match.group(3).strip()
    return found


def classify(required: dict[str, str]) -> dict[str, list[str]]:
    kit = {canonical(n) for n in KIT_WHEELS}
    out: dict[str, list[str]] = {"kit": [], "image": [], "left_out": [], "unplaced": []}
    for name in sorted(required):
        key = ("kit" if name in kit else "image" if name in IMAGE else
               "left_out" if name in LEFT_OUT else "unplaced")
        out[key].append(name)
    return out


def wheel_specs(required: dict[str, str]) -> list[str]:
    """pip requirement strings for the kit's wheels (the study's pin, else vLLM's own)."""
    return [f"{name}{pin or required.get(canonical(name), '')}"
            for name, pin in KIT_WHEELS.items()]


def pip_download(specs: list[str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-q", *PIP_TARGET, "-d", str(dest),
               *specs]
    print("$ " + " ".join(command), flush=True)
    if subprocess.run(command).returncode != 0:
        raise PrepareError(f"pip download failed for {specs}: check the network and that "
                           "each version exists for CPython 3.12 manylinux x86-64")


def slim(wheel: Path, payload: Path) -> dict[str, Any]:
    """Write payload/vllm-src.tar.xz (what travels of the wheel but its main library) and
    payload/vllm-lib.so.gz (that library); return what was kept and left behind."""
    payload.mkdir(parents=True, exist_ok=True)
    kept = dropped = kept_bytes = dropped_bytes = 0
    lib_bytes = 0
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        if MAIN_LIB not in names:
            raise PrepareError(f"{wheel.name} has no {MAIN_LIB}: not a vLLM >= 0.32 CUDA "
                               "wheel? (--wheel must be vllm-0.32.0-...manylinux...whl)")
        with lzma.open(payload / "vllm-src.tar.xz", "wb", preset=6) as xz, \
                tarfile.open(fileobj=xz, mode="w") as tar:
            for info in z.infolist():
                name = info.filename
                if info.is_dir() or name == MAIN_LIB:
                    continue
                if name in DROPPED_FILES or (name.endswith(DROPPED_SUFFIXES) and
                                             name not in SMALL_LIBS):
                    dropped, dropped_bytes = dropped + 1, dropped_bytes + info.file_size
                    continue
                entry = tarfile.TarInfo(name)
                entry.size, entry.mode = info.file_size, 0o644
                entry.mtime = int(time.mktime(info.date_time + (0, 0, -1)))
                with z.open(info) as src:
                    tar.addfile(entry, src)
                kept, kept_bytes = kept + 1, kept_bytes + info.file_size
        with z.open(MAIN_LIB) as src, gzip.open(payload / "vllm-lib.so.gz", "wb",
                                                compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
            lib_bytes = z.getinfo(MAIN_LIB).file_size
    return {"kept_files": kept, "kept_bytes": kept_bytes, "dropped_files": dropped,
            "dropped_bytes": dropped_bytes, "main_lib_bytes": lib_bytes}


def tree_bytes() -> int:
    """The project tree's size (it travels with every command)."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True)
    if listed.returncode != 0:
        raise PrepareError("not a git checkout: pass --tree-mib")
    return sum((REPO / n).stat().st_size for n in listed.stdout.decode().split("\0")
               if n and (REPO / n).is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--plan", action="store_true",
                   help="print the downloads, rules and limits; no network, writes nothing")
    p.add_argument("--wheel", type=Path, help="a vLLM wheel at hand (no download)")
    p.add_argument("--wheels-dir", type=Path, help="the missing wheels at hand (no download)")
    p.add_argument("--transfer-mib", type=float, default=64.0,
                   help="what one command may bring, project tree included")
    p.add_argument("--tree-mib", type=float,
                   help="the project tree's size (default: measured with git ls-files)")
    p.add_argument("--margin-mib", type=float, default=2.0)
    args = p.parse_args(argv)
    tree = int(args.tree_mib * 2**20) if args.tree_mib is not None else tree_bytes()
    capacity = int(args.transfer_mib * 2**20) - tree - int(args.margin_mib * 2**20)
    vllm_spec = f"vllm=={VLLM_VERSION}"
    if args.plan:
        pip = f"{sys.executable} -m pip download {' '.join(PIP_TARGET)}"
        specs = wheel_specs(requirements(args.wheel) if args.wheel else {})
        print(f"would download: {pip} -d {args.out / 'downloads'} {vllm_spec}")
        print(f"would download: {pip} -d {args.out / 'downloads' / 'wheels'} "
              + " ".join(specs))
        print(f"would keep of the wheel: Python sources, metadata, {sorted(SMALL_LIBS)}; "
              f"{MAIN_LIB} gzipped apart; leave behind: other {', '.join(DROPPED_SUFFIXES)} "
              f"files and {sorted(DROPPED_FILES)}")
        print("would check: Requires-Dist placed as kit / image / left out; sha256 of "
              "every part and file in manifest.json")
        print(f"per transfer: {capacity} bytes ({args.transfer_mib} MiB - tree {tree} B - "
              f"margin {args.margin_mib} MiB)")
        if capacity <= 0:
            raise SystemExit("nothing fits in a transfer: raise --transfer-mib")
        return 0
    out = args.out.resolve()
    downloads = out / "downloads"
    wheel = args.wheel
    if wheel is None:
        pip_download([vllm_spec], downloads)
        wheel = next(downloads.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    required = requirements(wheel)
    placed = classify(required)
    wheels_dir = args.wheels_dir
    if wheels_dir is None:
        wheels_dir = downloads / "wheels"
        pip_download(wheel_specs(required), wheels_dir)
    for stale in [out / "payload", *out.glob("transfer-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    payload = out / "payload"
    print(f"slimming {wheel.name} ...", flush=True)
    slimmed = slim(wheel, payload)
    wheels = sorted(wheels_dir.glob("*.whl"))
    for w in wheels:
        shutil.copyfile(w, payload / w.name)
    files = [(payload / "vllm-src.tar.xz", {"kind": "tar"}),
             (payload / "vllm-lib.so.gz", {"kind": "gzip", "to": MAIN_LIB}),
             *[(payload / w.name, {"kind": "wheel"}) for w in wheels]]
    manifest = write_transfers(files, out, capacity)
    manifest.update({"kit": "kv-offload GPU kit (benchmarks/gpu)", "vllm": VLLM_VERSION,
                     "vllm_wheel": wheel.name, "created": time.strftime(
                         "%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "slim": slimmed, "requirements": placed, "tree_bytes": tree,
                     "checks": ["vllm/__init__.py", MAIN_LIB, "vllm/platforms/cuda.py"]})
    save_manifest(manifest, out)
    total = sum(t["bytes"] for t in manifest["transfers"])
    print(json.dumps({"transfers": [(t["name"], t["bytes"]) for t in manifest["transfers"]],
                      "payload_bytes": total, "slim": slimmed,
                      "unplaced_requirements": placed["unplaced"]}, indent=1))
    if placed["unplaced"]:
        print(f"warning: vLLM requires {placed['unplaced']}, which the kit neither ships nor "
              "knows the GPU image to have: check before the GPU run", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
