"""On the GPU machine: stage each transfer of the kit, then join, check and install it.

    python3 benchmarks/gpu/unpack.py --stage /tmp/kvo-stage benchmarks/gpu/prepared/transfer-1
    python3 benchmarks/gpu/unpack.py --stage /tmp/kvo-stage --install /tmp/kvo-site \\
        benchmarks/gpu/prepared/transfer-2

Why two calls: one command's files are at most 64 MiB, and the machine keeps files from an
earlier command only while it stays warm (the next command within about 30 s). So each
command stages the parts it brought (each part's sha256 checked against the manifest) in a
folder outside the project tree, and the last one, with `--install`, joins every file,
checks its sha256 and installs it into one folder to put first on PYTHONPATH
(`run_on_gpu.py --site`): the wheels unzipped (what `pip install --no-deps --target` does
for wheels without scripts; no pip needed), vLLM's slimmed sources unpacked, its compiled
library unzipped into place. Standard library only. A missing or damaged part stops it with
the transfer to send again.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kit_parts import MANIFEST, KitFilesError, join, stage  # noqa: E402


def install(path: Path, rule: dict[str, Any], site: Path) -> None:
    """Install one joined file into `site` by its manifest rule."""
    kind = rule["kind"]
    if kind == "wheel":
        with zipfile.ZipFile(path) as wheel:
            wheel.extractall(site)
        for data in site.glob("*.data"):  # (purelib/platlib belong in site itself)
            for scheme in ("purelib", "platlib"):
                for item in (data / scheme).glob("*") if (data / scheme).is_dir() else []:
                    shutil.move(str(item), str(site / item.name))
            shutil.rmtree(data)
    elif kind == "tar":
        with tarfile.open(path) as tar:
            if hasattr(tarfile, "data_filter"):  # (Python >= 3.11.4: no links out of site)
                tar.extractall(site, filter="data")
            else:
                tar.extractall(site)
    elif kind == "gzip":
        target = site / rule["to"]
        target.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "rb") as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    else:
        raise KitFilesError(f"{path.name}: unknown install kind {kind!r} in the manifest "
                            "(prepare and unpack come from different versions of the kit?)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("transfers", nargs="*", type=Path, help="transfer folders brought now")
    p.add_argument("--stage", type=Path, required=True,
                   help="where parts wait between commands (outside the project tree)")
    p.add_argument("--install", type=Path, metavar="SITE",
                   help="join every file, check and install into SITE")
    args = p.parse_args(argv)
    try:
        for transfer in args.transfers:
            _, staged = stage(transfer, args.stage)
            print(f"staged {len(staged)} parts of {transfer.name} in {args.stage}")
        if args.install:
            joined_dir = args.stage / "joined"
            joined = join(args.stage, joined_dir)
            args.install.mkdir(parents=True, exist_ok=True)
            for path, rule in joined:
                install(path, rule, args.install)
                path.unlink()  # (the disk holds each file once)
            manifest = json.loads((args.stage / MANIFEST).read_text())
            missing = [c for c in manifest.get("checks", []) if not (args.install / c).exists()]
            if missing:
                raise KitFilesError(f"installed, but {missing} are not in {args.install}: "
                                    "prepare the kit again")
            print(f"installed {len(joined)} files into {args.install}: "
                  f"run_on_gpu.py --site {args.install}")
    except KitFilesError as error:
        print(f"unpack: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
