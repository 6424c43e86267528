"""What does identifying a model by every byte of its weights cost at start-up?

The weights identity (`kv_offload/vllm/weights.py`) reads every weight file once, then
remembers each file's digest by size, mtime, ctime, inode and device. This builds a model
directory of `--gib` GiB (`--shards` safetensors-like files of random bytes) and times, side
by side in one run, each `--repeats` times (medians):

  first start, cold     the digest cache empty, the files out of the page cache
                        (posix_fadvise DONTNEED after an fsync: clean pages are dropped)
  first start, warm     the digest cache empty, the files in the page cache (vLLM has just
                        read them, or the host reads them often)
  restart               the digest cache filled: nothing is read, only stat'ed
  weights load, cold    what vLLM's loader reads anyway (safetensors' load_file of every
                        shard into host memory): the time the identity overlaps with
  both at once, cold    the identity on its thread while the same files load, as the
                        connector starts it before vLLM loads the weights
  sampled (previous)    the previous identity: 16 reads of 64 KiB per file (cold)

    python benchmarks/bench_weights_identity.py --gib 4 --json weights-identity.json

The directory is built under `--dir` (default: a temporary directory, removed after).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kv_offload.runtime.file_digests import FileDigests
from kv_offload.vllm.weights import identify_weights


def build(directory: Path, gib: float, shards: int) -> None:
    per_shard = int(gib * 2**30 / shards)
    tensor_bytes = 64 << 20
    for shard in range(shards):
        tensors = {}
        for i in range(max(1, per_shard // tensor_bytes)):
            data = torch.randint(-128, 127, (tensor_bytes,), dtype=torch.int8)
            tensors[f"model.layers.{shard}.{i}.weight"] = data.view(torch.bfloat16)
        save_file(tensors, directory / f"model-{shard:05d}-of-{shards:05d}.safetensors")


def drop_from_page_cache(directory: Path) -> None:
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sampled_identity(directory: Path) -> None:
    """The previous identity's reads (16 x 64 KiB per file), for the comparison."""
    for path in sorted(directory.glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            for i in range(16):
                f.seek(max(0, size - 65536) * i // 15)
                f.read(65536)


def load_weights(directory: Path) -> None:
    """Every tensor copied into memory of its own, as a loader copies into parameters
    (load_file alone maps the file: nothing would be read)."""
    for path in sorted(directory.glob("*.safetensors")):
        for tensor in load_file(path).values():
            tensor.clone()


def timed(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def both_at_once(directory: Path, cache: Path) -> float:
    """The identity on its thread while the weights load, as at an engine's start."""
    thread = threading.Thread(target=identify_weights, args=(str(directory),),
                              kwargs={"digests": FileDigests(cache)})
    start = time.perf_counter()
    thread.start()
    load_weights(directory)
    thread.join()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-weights-", dir=args.dir))
    model, caches = work / "model", work / "caches"
    model.mkdir()
    try:
        build(model, args.gib, args.shards)
        total = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        times: dict[str, list[float]] = {}

        def add(name: str, seconds: float) -> None:
            times.setdefault(name, []).append(seconds)

        for repeat in range(args.repeats):
            cache = caches / str(repeat)
            drop_from_page_cache(model)
            add("first start, cold", timed(identify_weights, str(model),
                                           digests=FileDigests(cache / "cold")))
            add("first start, warm", timed(identify_weights, str(model),
                                           digests=FileDigests(cache / "warm")))
            add("restart", timed(identify_weights, str(model),
                                 digests=FileDigests(cache / "warm")))
            drop_from_page_cache(model)
            add("weights load, cold", timed(load_weights, model))
            drop_from_page_cache(model)
            add("both at once, cold", both_at_once(model, cache / "both"))
            drop_from_page_cache(model)
            add("sampled (previous), cold", timed(sampled_identity, model))
        rows = [{"case": name, "median_s": statistics.median(values),
                 "runs_s": values, "gib_per_s": total / 2**30 / statistics.median(values)}
                for name, values in times.items()]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"model directory: {total / 2**30:.2f} GiB in {args.shards} files; "
          f"median of {args.repeats}")
    print(f"{'case':28} {'median s':>9} {'GiB/s':>7}   runs")
    for row in rows:
        runs = " ".join(f"{t:.3f}" for t in row["runs_s"])
        print(f"{row['case']:28} {row['median_s']:9.3f} {row['gib_per_s']:7.2f}   {runs}")
    load = next(r["median_s"] for r in rows if r["case"] == "weights load, cold")
    both = next(r["median_s"] for r in rows if r["case"] == "both at once, cold")
    print(f"added to a cold weights load by the identity on its thread: {both - load:+.3f} s "
          f"({(both / load - 1) * 100:+.0f}%)")
    if args.json:
        args.json.write_text(json.dumps({"total_bytes": total, "shards": args.shards,
                                         "repeats": args.repeats, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
