"""The CPU one S3 request costs the engine's process (issue 25: the worker's step cost).

botocore's Python costs about 4 ms of CPU per request. Run on the tier's threads inside the
engine's process it is time the engine thread may wait for the interpreter lock
(`bench_step_cost.py --tier s3`: the worker's wall p99 above its CPU p99); the tier runs it
in a helper process by default (`helper_process`). This measures, against a moto server in
another process (its CPU is not counted):

  client_put    one `put_object` (`If-None-Match: *`) of a block's record, on a client
                made as the tier makes its own (`make_client` on the tier's configuration):
                the calling thread's CPU per request
  client_get    one ranged `get_object` of such a record, read whole: the same
  tier_write    `S3Tier.submit_write` of `--batch` blocks, waited for: this process's CPU
                (every thread: packing, checksum, the I/O threads' requests or their
                hand-off to the helper, and the main thread's polls for the result, every
                millisecond) per block; the tier's listing crawl is off
  tier_read     `S3Tier.submit_read` of those blocks into host buffers, verified: the same
  helper_write  the helper process's CPU per block during tier_write (with the helper)
  helper_read   the same during tier_read
  inproc_write  tier_write with `helper_process: false` (botocore in this process), the
  inproc_read   same blocks and server, in the same round: the before, side by side

Each figure is the median over `--rounds` rounds of `--requests` requests (or blocks) each,
every request on a new key (a key-dependent cost shows). With `--compare TREE ...` every
tree (a directory holding `kv_offload` and, say, another botocore: `pip install --target
TREE --no-deps boto3==X botocore==X`) runs in a child process with `PYTHONPATH=TREE`, the
trees alternating round by round, and the table gives the ratio of each to the first (a tree
without the helper has no helper_* or inproc_* columns: its tier_* are in-process):

    python benchmarks/bench_s3_request_cpu.py --json s3-request-cpu.json
    python benchmarks/bench_s3_request_cpu.py --compare /tmp/old-botocore .
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WAYS = ("client_put", "client_get", "tier_write", "tier_read", "helper_write", "helper_read",
        "inproc_write", "inproc_read")
BUCKET = "request-cpu-bench"


def measure(args) -> dict:
    """One round of every way in this process, against a fresh moto server."""
    import botocore
    import torch

    from kv_offload.backends.record import CHECKSUM, NETWORK_ALIGN, pack
    from kv_offload.backends.s3 import S3Tier
    from kv_offload.backends.s3.client import make_client
    from kv_offload.backends.s3.local_server import TEST_CREDENTIALS, LocalS3Server

    os.environ.update(TEST_CREDENTIALS)
    block = torch.randint(-128, 127, (args.block_kib * 1024,), dtype=torch.int8)
    cpu: dict[str, float] = {}
    with LocalS3Server() as server:
        options = {"bucket": BUCKET, "endpoint_url": server.endpoint_url,
                   "bytes_to_use": "8GiB", "connections": args.connections,
                   "refresh_interval_s": 0}  # (no crawl: its CPU would count as the jobs')
        tier = S3Tier.from_options(options, "request-cpu")
        try:
            client = make_client(tier.config)  # (the tier's configuration: a client like its own)
            client.create_bucket(Bucket=BUCKET)
            names = [f"bench/{args.seed}-{i:08d}" for i in range(args.requests)]
            record = pack(b"k" * 32, "request-cpu", memoryview(block.numpy()), align=NETWORK_ALIGN,
                          codec=CHECKSUM)
            for name in names[:8]:  # warm the connection and botocore's caches
                client.put_object(Bucket=BUCKET, Key=name + "-warm", Body=record)
            start = time.thread_time()
            for name in names:
                client.put_object(Bucket=BUCKET, Key=name, Body=record, IfNoneMatch="*")
            cpu["client_put"] = (time.thread_time() - start) / len(names)
            start = time.thread_time()
            for name in names:
                client.get_object(Bucket=BUCKET, Key=name,
                                  Range=f"bytes=0-{len(record) - 1}")["Body"].read()
            cpu["client_get"] = (time.thread_time() - start) / len(names)

            keys = [f"{args.seed}-{i:08d}".encode().ljust(32, b"k") for i in range(args.requests)]
            buffers = [block.clone() for _ in range(args.batch)]
            cpu.update(_tier_jobs(tier, keys, buffers, args.batch, ""))
        finally:
            tier.close()
        if "helper_process" in {f.name for f in dataclasses.fields(tier.config)}:
            tier = S3Tier.from_options({**options, "helper_process": False}, "request-cpu")
            try:  # (new keys: the first tier's are there, and would be skipped as present)
                cpu.update(_tier_jobs(tier, [k[:-1] + b"i" for k in keys], buffers,
                                      args.batch, "inproc_"))
            finally:
                tier.close()
    return {"botocore": botocore.__version__, "cpu_ms": {k: v * 1e3 for k, v in cpu.items()}}


def _tier_jobs(tier, keys: list[bytes], buffers, batch: int, prefix: str) -> dict:
    """Write then read `keys` through `tier`: this process's CPU per block (and, with a
    helper process, the helper's)."""
    cpu = {}
    helper = getattr(tier._s3, "pid", None)  # (a HelperClient's)
    for way, submit in (("write", tier.submit_write), ("read", tier.submit_read)):
        start, start_helper = time.process_time(), _process_cpu(helper)
        for at in range(0, len(keys), batch):
            part = keys[at:at + batch]
            job = submit(part, buffers[:len(part)])
            _wait(tier, job, way)
        cpu[(prefix or "tier_") + way] = (time.process_time() - start) / len(keys)
        if helper is not None:
            cpu["helper_" + way] = (_process_cpu(helper) - start_helper) / len(keys)
    return cpu


def _process_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` so far (its threads included)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait(tier, job: int, way: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for result in tier.poll():
            if result.job_id == job:
                if not result.ok:
                    raise RuntimeError(f"{way}: {len(result.failed_keys)} blocks failed")
                return
        time.sleep(0.001)
    raise RuntimeError(f"{way}: the job did not end within 60 s")


def child(tree: str, argv: list[str], seed: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    out = subprocess.run([sys.executable, __file__, *argv, "--one-round", "--seed", str(seed)],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", nargs="+", metavar="TREE",
                        help="trees measured side by side (default: this environment)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16, help="blocks per tier job")
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--one-round", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_round:
        print(json.dumps(measure(args)))
        return 0
    child_argv = ["--requests", str(args.requests), "--batch", str(args.batch),
                  "--block-kib", str(args.block_kib), "--connections", str(args.connections)]
    trees = args.compare or [str(Path(__file__).resolve().parent.parent)]
    rounds: dict[str, list[dict]] = {tree: [] for tree in trees}
    for r in range(args.rounds):
        for k in range(len(trees)):  # (the order rotates round by round)
            tree = trees[(r + k) % len(trees)]
            rounds[tree].append(child(tree, child_argv, seed=r))
    medians = {tree: {way: statistics.median(x["cpu_ms"].get(way, math.nan) for x in runs)
                      for way in WAYS} for tree, runs in rounds.items()}
    print(f"CPU of the engine's process per S3 request (ms, median of {args.rounds} rounds of "
          f"{args.requests}; {args.block_kib} KiB blocks; load average "
          f"{os.getloadavg()[0]:.1f})")
    print(f"{'tree (botocore)':44s}" + "".join(f"{way:>13s}" for way in WAYS))
    base = medians[trees[0]]
    for tree in trees:
        name = f"{tree} ({rounds[tree][0]['botocore']})"
        print(f"{name[-44:]:44s}" + "".join(f"{medians[tree][way]:13.3f}" for way in WAYS))
        if tree != trees[0]:
            print(f"{'  x first':44s}" + "".join(f"{medians[tree][w] / base[w]:13.2f}"
                                                 for w in WAYS))
    if args.json:
        args.json.write_text(json.dumps({"trees": trees, "rounds": rounds, "medians": medians,
                                         "load_average": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
