"""`kv-offload bench`: store/load throughput of one tier against a baseline measured in the
same run, every byte checked.

Tiers (`--tier`): ``host`` (the host tier's copies against a plain torch copy, `bench_cpu`),
``filesystem`` (the disk tier against raw O_DIRECT I/O of the same bytes), ``valkey``, ``s3``
and any ``package.module:ClassName`` storage tier (against the filesystem tier; `bench_tiers`).
The old spellings (``--backend``, ``cpu``) still work until 0.2, with a note on stderr.

Every tier honours the common flags the same way, or refuses the run:

- ``--repeats N``: runs per measurement; the JSON keeps every sample and reports the best
  (`report.STATISTIC`).
- ``--seed N``: the random data and block/slot choices.
- ``--batch-mib N``: bytes per submitted job (the host tier: one job; storage tiers: keys
  per job = batch / value size).
- ``--page-kib N``: the unit moved per key: the host tier's page (a synthetic model), a
  storage tier's value size (several values: a sweep).
- ``--json PATH``: the envelope of `report` (``-``: stdout, the table then goes to stderr).

A flag a tier cannot honour (``--fs-root`` for ``host``, ``--layout`` for ``valkey``...) is
refused with a message naming the flag and the tier, exit status 2: nothing is ever
silently ignored. Exit status 1 when any byte mismatched or any key failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from kv_offload.config import COMPRESSION_CHOICES
from kv_offload.errors import BenchArgumentError, ConfigError
from kv_offload.testing.engine_alloc import LAYOUTS
from kv_offload.testing.example_models import EXAMPLE_MODELS
from kv_offload.tools.plots import plot_path
from kv_offload.tools.report import STATISTIC, Table, emit, envelope, output_path

BUILTIN_TIERS = ("host", "filesystem", "valkey", "s3")
# Old spellings, accepted with a note on stderr until 0.2: --backend NAME, and "cpu".
OLD_TIER_NAMES = {"cpu": "host"}
COMMON = ("repeats", "seed", "batch_mib", "page_kib", "json")
TIER_FLAGS = ("fs_root", "total_mib", "connections", "record_modes", "compression", "plot")
# The flags each tier honours besides COMMON; any other flag given is refused.
HONOURED: dict[str, tuple[str, ...]] = {
    "host": ("model", "layers", "layout", "pattern", "device"),
    "filesystem": TIER_FLAGS,
    "valkey": (*TIER_FLAGS, "url", "cluster"),
    "s3": (*TIER_FLAGS, "endpoint_url", "bucket"),
    "module:Class": ("fs_root", "total_mib", "tier_options", "plot"),
}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    # Tier-specific flags default to None, so a flag the user gave can be told apart
    # from one left alone (and refused where it does not apply).
    parser.add_argument("--tier", default=None, metavar="NAME",
                        help=f"{', '.join(BUILTIN_TIERS)} or package.module:ClassName (a "
                             "StorageTier, benchmarked like valkey/s3; default host)")
    parser.add_argument("--backend", default=None, help=argparse.SUPPRESS)  # (old --tier)
    common = parser.add_argument_group("every tier")
    common.add_argument("--repeats", type=int, default=3,
                        help=f"runs per measurement; the {STATISTIC} is reported (default 3)")
    common.add_argument("--seed", type=int, default=0, help="random data and choices")
    common.add_argument("--batch-mib", type=float, default=None, metavar="MIB",
                        help="bytes per job (default: host 256; filesystem 16 values; "
                             "valkey/s3 4 values)")
    common.add_argument("--page-kib", type=int, nargs="+", default=None, metavar="KIB",
                        help="bytes per key: host: the page of a synthetic model (overrides "
                             "--model); tiers: value sizes, a sweep (default: filesystem "
                             "2048; valkey/s3 1024 4096 16384)")
    common.add_argument("--json", metavar="PATH", type=output_path,
                        help="write the results here ('-': stdout, the table to stderr)")
    cpu = parser.add_argument_group("--tier host")
    cpu.add_argument("--model", choices=sorted(EXAMPLE_MODELS), default=None,
                     help="example model (default llama-8b)")
    cpu.add_argument("--layers", type=int, default=None,
                     help="layers of the synthetic --page-kib model (default 1)")
    cpu.add_argument("--layout", choices=sorted(LAYOUTS), default=None,
                     help="engine cache layout (default LBNHC)")
    cpu.add_argument("--pattern", choices=["fresh", "scattered"], default=None,
                     help="slot ids: consecutive as a fresh manager hands them out (default), "
                          "or a random subset")
    cpu.add_argument("--device", choices=["cpu", "cuda"], default=None,
                     help="where the engine's kv_caches live (default cpu); cuda: the GPU "
                          "path (needs kv-offload[cuda]), the host pool pinned")
    tiers = parser.add_argument_group("--tier filesystem|valkey|s3|module:Class")
    tiers.add_argument("--fs-root", default=None,
                       help="a directory on the disk to measure, not tmpfs (default "
                            "/tmp/kv-offload-bench)")
    tiers.add_argument("--total-mib", type=float, default=None,
                       help="bytes written and read per cell (default 256)")
    tiers.add_argument("--connections", type=int, nargs="+", default=None,
                       help="connections (filesystem: io threads), a sweep (default: "
                            "filesystem 8; valkey/s3 1 4 8)")
    tiers.add_argument("--url", default=None,
                       help="valkey: redis://HOST:PORT/DB (default: a loopback server)")
    tiers.add_argument("--cluster", type=int, default=None, metavar="PRIMARIES",
                       help="valkey: a loopback Cluster of this many primaries, one replica "
                            "each, instead of one server (not with --url)")
    tiers.add_argument("--endpoint-url", default=None,
                       help="s3: the endpoint (default: moto on loopback)")
    tiers.add_argument("--bucket", default=None, help="s3: an existing bucket")
    tiers.add_argument("--record-modes", nargs="+", default=None, metavar="MODE",
                       choices=["plain", "auth", "encrypt"],
                       help="run each built-in tier once per record mode, same cells, same "
                            "run: plain (no secret), auth (secret_file: HMAC tags), encrypt "
                            "(AES-GCM); rows 'TIER+auth', 'TIER+encrypt' (default: plain)")
    tiers.add_argument("--compression", nargs="+", default=None, metavar="CODEC",
                       choices=list(COMPRESSION_CHOICES),
                       help="run each built-in tier once per compression setting, same "
                            "cells, same run, over bf16 KV-like values (Gaussian) instead of "
                            "random bytes: rows 'TIER' (off) and 'TIER+CODEC', with the bytes "
                            "stored per page byte (choices: %(choices)s)")
    tiers.add_argument("--plot", default=None, metavar="PATH", type=plot_path,
                       help="also draw GB/s by value size and connections in this PNG "
                            "(needs the plots extra: matplotlib)")
    tiers.add_argument("--tier-options", default=None, metavar="JSON",
                       help="module:Class: its storage_options, as JSON (default {})")


def tier_kind(tier: str) -> str:
    if tier in BUILTIN_TIERS:
        return tier
    if ":" in tier:
        return "module:Class"
    raise BenchArgumentError(f"--tier {tier!r}: expected one of "
                             f"{', '.join(BUILTIN_TIERS)} or package.module:ClassName")


def settle_tier(args: argparse.Namespace) -> None:
    """`args.tier` from `--tier`, or from the old spellings (`--backend`, `cpu`) with a note
    on stderr naming the new one; default host."""
    if args.backend is not None:
        if args.tier is not None:
            raise BenchArgumentError("--backend is the old name of --tier: give only --tier")
        print("kv-offload bench: --backend is now --tier (the old flag goes in 0.2)",
              file=sys.stderr)
        args.tier = args.backend
    args.tier = args.tier or "host"
    if args.tier in OLD_TIER_NAMES:
        new = OLD_TIER_NAMES[args.tier]
        print(f"kv-offload bench: the {args.tier!r} tier is now {new!r} (the old name goes "
              f"in 0.2)", file=sys.stderr)
        args.tier = new


def check_bench_arguments(args: argparse.Namespace) -> None:
    """Raise BenchArgumentError for any flag the tier cannot honour or any bad value."""
    settle_tier(args)
    kind = tier_kind(args.tier)
    given = [name for name in vars(args)
             if name not in ("tier", "backend", "run", "command") and name not in COMMON
             and getattr(args, name) is not None]
    for name in given:
        if name not in HONOURED[kind]:
            users = [b for b, flags in HONOURED.items() if name in flags]
            raise BenchArgumentError(
                f"--{name.replace('_', '-')} does not apply to --tier {args.tier} "
                f"(only to {', '.join(users)}); this tier honours: "
                f"{', '.join('--' + f.replace('_', '-') for f in (*COMMON, *HONOURED[kind]))}")
    if getattr(args, "cluster", None) is not None and getattr(args, "url", None) is not None:
        raise BenchArgumentError("--cluster starts a loopback cluster; --url names a server: "
                                 "give one of them (a --url of any cluster node works too)")
    for name in ("repeats", "batch_mib", "total_mib", "layers", "cluster"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise BenchArgumentError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("page_kib", "connections"):
        values = getattr(args, name) or []
        if any(v <= 0 for v in values):
            raise BenchArgumentError(f"--{name.replace('_', '-')} must be positive, got "
                                     f"{values}")
    if kind == "host":
        if args.page_kib is not None and len(args.page_kib) != 1:
            raise BenchArgumentError(f"--tier host takes one --page-kib (a synthetic "
                                     f"model's page), got {args.page_kib}")
        if args.layers is not None and args.page_kib is None:
            raise BenchArgumentError("--layers shapes the synthetic model: give --page-kib "
                                     "too (an example --model has its own layers)")
        if args.model is not None and args.page_kib is not None:
            raise BenchArgumentError("--model and --page-kib both choose the model: give one")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise BenchArgumentError("--device cuda: torch sees no CUDA GPU here (a CUDA build "
                                     "of torch and a GPU are needed); leave --device out to "
                                     "measure the CPU path")
    if kind == "s3" and args.endpoint_url is None and args.bucket is not None:
        raise BenchArgumentError("--bucket names a bucket of --endpoint-url: give both "
                                 "(without them a loopback moto server is started)")
    if kind == "s3" and args.endpoint_url is not None and args.bucket is None:
        raise BenchArgumentError("--endpoint-url needs --bucket (an existing bucket)")


def run_bench(args: argparse.Namespace) -> int:
    """Run, print the table, write the envelope; 2 on refused flags, 1 on any bad byte/key."""
    try:
        check_bench_arguments(args)
    except BenchArgumentError as e:
        print(f"kv-offload bench: {e}", file=sys.stderr)
        return 2
    run = RUNS[tier_kind(args.tier)]
    try:
        result, table = run(args)
    except (BenchArgumentError, ConfigError) as e:  # e.g. a module:Class tier's options
        print(f"kv-offload bench: {e}", file=sys.stderr)
        return 2
    emit([table], envelope("bench", result, STATISTIC), args.json)
    if getattr(args, "plot", None) is not None:
        from kv_offload.tools.plots import run_note, tier_throughput

        tier_throughput(result, args.plot, run_note())
    return 0 if result["mismatches"] == 0 and result["failed_keys"] == 0 else 1


def _cpu(args: argparse.Namespace) -> tuple[dict, Table]:
    from kv_offload.tools.bench_cpu import bench_cpu, cpu_table

    result = bench_cpu(args)
    return result, cpu_table(result)


def _filesystem(args: argparse.Namespace) -> tuple[dict, Table]:
    from kv_offload.tools.bench_filesystem import run_filesystem_bench
    from kv_offload.tools.bench_tiers import tier_table

    result = run_filesystem_bench(args)
    return result, tier_table(result)


def _tier(args: argparse.Namespace) -> tuple[dict, Table]:
    from kv_offload.tools.bench_stores import run_shared_store_bench
    from kv_offload.tools.bench_tiers import tier_table

    result = run_shared_store_bench(args)
    return result, tier_table(result)


# Each tier's bench returns its JSON result and its table.
RUNS: dict[str, Callable[[argparse.Namespace], tuple[dict, Table]]] = {
    "host": _cpu, "filesystem": _filesystem, "valkey": _tier, "s3": _tier, "module:Class": _tier}
