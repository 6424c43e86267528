"""Split files into transfers under a size limit, checksum them, and join them back.

Why: the lent GPU machine receives files only with a command, at most 64 MiB at a time
(project tree included), and has no network. benchmarks/gpu/prepare.py cuts what must travel
(vLLM's slimmed sources, its compiled library, the missing wheels) into parts that fill as
few transfers as possible; benchmarks/gpu/unpack.py stages the parts of each transfer on the
GPU machine, then joins every file and installs it. The standard library only: this module
runs on the GPU machine before anything is installed.

The manifest (manifest.json, a copy in every transfer) names every file with its sha256 and
size, and every part with its transfer, offset, size and sha256, so a part that arrived
damaged or a transfer that never arrived is named, with the transfer to send again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
CHUNK = 1 << 20


class KitFilesError(RuntimeError):
    """A part or file of the kit is missing or damaged; the message names the fix."""


@dataclass
class Part:
    name: str          # file name of the part, e.g. "vllm-lib.gz.part01"
    transfer: str      # the transfer folder it travels in, e.g. "transfer-1"
    offset: int        # where it starts in the whole file
    size: int
    sha256: str = ""


@dataclass
class KitFile:
    name: str                      # e.g. "vllm-src.tar.xz"
    size: int
    sha256: str
    install: dict[str, Any]        # how unpack.py installs it (see unpack.py)
    parts: list[Part] = field(default_factory=list)


def sha256_of(path: Path, offset: int = 0, size: int | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(offset)
        left = path.stat().st_size - offset if size is None else size
        while left > 0:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def plan_transfers(sizes: list[tuple[str, int]], capacity: int) -> list[list[Part]]:
    """Fill transfers of `capacity` bytes with the files in order, cutting a file where a
    transfer is full: the fewest transfers, each part at most `capacity` bytes."""
    if capacity <= 0:
        raise KitFilesError(f"a transfer holds {capacity} bytes: nothing fits (raise "
                            "--transfer-mib or lower --tree-mib)")
    transfers: list[list[Part]] = [[]]
    room = capacity
    for name, size in sizes:
        offset, index = 0, 1
        while True:
            if room == 0:
                transfers.append([])
                room = capacity
            length = min(room, size - offset)
            transfers[-1].append(Part(f"{name}.part{index:02d}", f"transfer-{len(transfers)}",
                                      offset, length))
            offset, room, index = offset + length, room - length, index + 1
            if offset >= size:
                break
    return transfers


def write_transfers(files: list[tuple[Path, dict[str, Any]]], out: Path,
                    capacity: int) -> dict[str, Any]:
    """Cut `files` (path, install rule) into out/transfer-N/ folders and write the manifest
    there and in every transfer. Returns the manifest."""
    kit_files = {path.name: KitFile(path.name, path.stat().st_size, sha256_of(path), install)
                 for path, install in files}
    paths = {path.name: path for path, _ in files}
    plan = plan_transfers([(f.name, f.size) for f in kit_files.values()], capacity)
    for transfer in plan:
        for part in transfer:
            whole = part.name.rsplit(".part", 1)[0]
            folder = out / part.transfer
            folder.mkdir(parents=True, exist_ok=True)
            with paths[whole].open("rb") as src, (folder / part.name).open("wb") as dst:
                src.seek(part.offset)
                left = part.size
                while left:
                    chunk = src.read(min(CHUNK, left))
                    dst.write(chunk)
                    left -= len(chunk)
            part.sha256 = sha256_of(folder / part.name)
            kit_files[whole].parts.append(part)
    manifest = {"files": [asdict(f) for f in kit_files.values()],
                "transfers": [{"name": t[0].transfer, "bytes": sum(p.size for p in t),
                               "parts": [p.name for p in t]} for t in plan],
                "transfer_capacity": capacity}
    return manifest


def save_manifest(manifest: dict[str, Any], out: Path) -> None:
    text = json.dumps(manifest, indent=1)
    (out / MANIFEST).write_text(text)
    for transfer in manifest["transfers"]:
        (out / transfer["name"] / MANIFEST).write_text(text)


def stage(transfer_dir: Path, stage_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """Check every part in `transfer_dir` against the manifest and copy it into
    `stage_dir`; returns the manifest and the parts staged now."""
    manifest = json.loads((transfer_dir / MANIFEST).read_text())
    stage_dir.mkdir(parents=True, exist_ok=True)
    expected = {p["name"]: p for f in manifest["files"] for p in f["parts"]
                if p["transfer"] == transfer_dir.name}
    if not expected:
        raise KitFilesError(f"{transfer_dir} is not a transfer of this manifest (its name "
                            f"must be one of {[t['name'] for t in manifest['transfers']]})")
    staged = []
    for name, part in sorted(expected.items()):
        path = transfer_dir / name
        if not path.exists():
            raise KitFilesError(f"{name} is missing from {transfer_dir}: send "
                                f"{part['transfer']} again")
        if path.stat().st_size != part["size"] or sha256_of(path) != part["sha256"]:
            raise KitFilesError(f"{name} in {transfer_dir} is damaged (size or sha256 differ "
                                f"from the manifest): send {part['transfer']} again")
        shutil.copyfile(path, stage_dir / name)
        staged.append(name)
    (stage_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest, staged


def join(stage_dir: Path, into: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Join every file of the staged manifest into `into`, checking each whole file's
    sha256; returns (path, install rule) per file."""
    manifest = json.loads((stage_dir / MANIFEST).read_text())
    missing = sorted({p["transfer"] for f in manifest["files"] for p in f["parts"]
                      if not (stage_dir / p["name"]).exists()})
    if missing:
        raise KitFilesError(f"parts of {missing} are not staged in {stage_dir}: send "
                            f"{', '.join(missing)} (each within 30 s of the last command, "
                            "or staged files are gone with the machine)")
    into.mkdir(parents=True, exist_ok=True)
    joined = []
    for entry in manifest["files"]:
        target = into / entry["name"]
        with target.open("wb") as dst:
            for part in sorted(entry["parts"], key=lambda p: p["offset"]):
                with (stage_dir / part["name"]).open("rb") as src:
                    shutil.copyfileobj(src, dst, CHUNK)
        if target.stat().st_size != entry["size"] or sha256_of(target) != entry["sha256"]:
            raise KitFilesError(f"{entry['name']} joined from its parts differs from the "
                                "manifest's sha256: prepare the kit again and send every "
                                "transfer")
        joined.append((target, entry["install"]))
    return joined
