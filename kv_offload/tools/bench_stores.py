"""`kv-offload bench --tier valkey|s3|package.module:ClassName`: a shared-store tier (or any
`StorageTier`) against the filesystem tier, same cells, same run (`bench_tiers`).

    kv-offload bench --tier valkey   # a loopback redis-server/valkey-server is started
    kv-offload bench --tier valkey --url redis://HOST:6379/0
    kv-offload bench --tier valkey --cluster 3   # a loopback cluster, 3 primaries
    kv-offload bench --tier s3       # moto's server on loopback: NOT a performance reference
    kv-offload bench --tier s3 --endpoint-url http://minio:9000 --bucket kv-bench
    kv-offload bench --tier mypkg.tier:MyTier --tier-options '{"max_bytes": 1073741824}'

Loopback numbers measure the client, the server and the memory copies on this machine, not
a network. ``--record-modes plain auth encrypt`` runs the built-in tiers once per record mode
(rows ``TIER``, ``TIER+auth``, ``TIER+encrypt``), with a random secret of the run's own: the
cost of ``secret_file`` and of ``encrypt: true``, measured side by side. A ``module:Class``
tier is opened with ``from_options(--tier-options)``, as the connector opens it; it has no
connection count of its own (one cell per value size).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import secrets
import shutil

from kv_offload.backends.base import StorageTier
from kv_offload.backends.record import CHECKSUM, RecordCodec
from kv_offload.errors import BenchArgumentError
from kv_offload.tools.bench_tiers import (
    MIB,
    BenchPlan,
    BenchTier,
    RawCell,
    RawMeasure,
    TierFactory,
    run_tier_bench,
)

DEFAULT_PAGE_KIB = (1024, 4096, 16384)
DEFAULT_CONNECTIONS = (1, 4, 8)
DEFAULT_TOTAL_MIB = 256
DEFAULT_FS_ROOT = "/tmp/kv-offload-bench"
VALUES_PER_JOB = 4  # without --batch-mib
LAYOUT = "bench-layout"


def plan_from_args(args: argparse.Namespace, page_kib: tuple[int, ...],
                   connections: tuple[int, ...], values_per_job: int) -> BenchPlan:
    """The cells `--page-kib`, `--connections`, `--total-mib` and `--batch-mib` ask for."""
    batch = None if args.batch_mib is None else int(args.batch_mib * MIB)
    return BenchPlan(
        page_bytes=tuple(k * 1024 for k in (args.page_kib or page_kib)),
        connections=tuple(getattr(args, "connections", None) or connections),
        total_bytes=int((args.total_mib or DEFAULT_TOTAL_MIB) * MIB),
        values_per_job=(lambda size: values_per_job) if batch is None
        else (lambda size: max(1, batch // size)),
        repeats=args.repeats, seed=args.seed, work_root=args.fs_root or DEFAULT_FS_ROOT,
        kv_like=bool(getattr(args, "compression", None)))


def with_record_modes(tiers: dict[str, BenchTier], modes: list[str] | None,
                      compressions: list[str] | None = None) -> dict:
    """Each tier once per record mode (``--record-modes``) and compression setting
    (``--compression``; "off" is always run first, the baseline of the others): a factory
    given the codec."""
    from kv_offload.backends.common.compression import OFF, make_compression
    from kv_offload.backends.common.sealing import Authenticated, Encrypted

    secret = secrets.token_bytes(32)  # (this run's own: nothing is kept)
    codecs = {"plain": CHECKSUM, "auth": Authenticated(secret), "encrypt": Encrypted(secret)}
    settings = [OFF, *(c for c in dict.fromkeys(compressions or []) if c != OFF)]
    rows = {}
    for name, tier in tiers.items():
        for mode in modes or ["plain"]:
            for setting in settings:
                row = name + ("" if mode == "plain" else f"+{mode}") + \
                    ("" if setting == OFF else f"+{setting}")
                codec = codecs[mode].with_compression(make_compression(setting))
                rows[row] = BenchTier(functools.partial(tier.make, codec=codec),
                                      tier.clear_after)
    return rows


def filesystem_factory(conns: int, workdir: str,
                       codec: RecordCodec = CHECKSUM) -> StorageTier:
    """The filesystem tier in a fresh directory (under --fs-root), ``conns`` io threads."""
    from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig

    budget = shutil.disk_usage(workdir).free  # never the limit; within the disk's size
    return FilesystemTier(FilesystemTierConfig(workdir, LAYOUT, budget, io_threads=conns,
                                               rescan_interval_s=0, codec=codec))


def run_shared_store_bench(args: argparse.Namespace) -> dict:
    """Start a loopback server unless one is named; run the cells against the filesystem tier."""
    with contextlib.ExitStack() as stack:
        raw: list[RawMeasure] = []
        connections = DEFAULT_CONNECTIONS
        if args.tier == "valkey":
            make, note = _valkey_factory(args, stack)
            if args.url is None:
                raw = _server_alone(make)
        elif args.tier == "s3":
            make, note = _s3_factory(args, stack)
        else:
            make, note = _module_factory(args)
            connections = (1,)
        # Our own Valkey server evicts on its own; a server named by --url is cleaned up.
        keep = args.tier == "valkey" and args.url is None
        tiers = {args.tier: BenchTier(make, clear_after=not keep),
                 "filesystem": BenchTier(filesystem_factory)}
        if args.record_modes or args.compression:
            tiers = with_record_modes(tiers, args.record_modes, args.compression)
        return run_tier_bench(
            args.tier, tiers, plan_from_args(args, DEFAULT_PAGE_KIB, connections,
                                                VALUES_PER_JOB),
            baseline="filesystem", baseline_note="the filesystem tier, same cells, same run",
            note=note, raw=raw)


def fill_until_evicting(url: str, value_bytes: int = 16 * MIB, cluster: bool = False) -> None:
    """Write filler values until the server starts evicting (its memory is then all in use;
    a cluster: until every primary has evicted)."""
    import redis
    from redis.cluster import RedisCluster

    client = RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
    filler = bytes(value_bytes)
    for i in itertools.count():
        client.set(f"kv-offload-bench-fill:{i}", filler)
        if cluster:
            if i % 8 == 0 and all(s["evicted_keys"] > 0 for s in client.info(
                    "stats", target_nodes=RedisCluster.PRIMARIES).values()):
                return
        elif client.info("stats")["evicted_keys"] > 0:
            return


def _server_alone(make) -> list[RawMeasure]:
    """redis-benchmark on the bench's own server, if the binary is there."""
    from kv_offload.tools.bench_valkey_server import benchmark_binary, server_alone_gbps

    binary = benchmark_binary()
    if binary is None:
        return []
    port, cluster = make.server.port, make.cluster

    def run(cell: RawCell) -> tuple[float, float]:
        return server_alone_gbps(binary, port, cell.value_bytes, cell.connections, cell.values,
                                 cluster=cluster)
    return [RawMeasure(os.path.basename(binary), run)]


def _valkey_factory(args, stack: contextlib.ExitStack) -> tuple[TierFactory, str]:
    from kv_offload.backends.valkey import ValkeyTier

    url, note, server = args.url, f"server {args.url}", None
    primaries = getattr(args, "cluster", None)
    if url is None:
        from kv_offload.backends.valkey.local_cluster import LocalCluster
        from kv_offload.backends.valkey.local_server import LocalServer

        # Room for four cells; filled first, so the benchmark runs on a full, warm cache
        # that evicts (LRU) as a server in service does.
        total_mib = args.total_mib or DEFAULT_TOTAL_MIB
        if primaries:  # (each primary holds its share of the keys; at least 32 MB: a
            # cluster node's own buffers take a few, and a filler value is 16 MiB)
            per_node = max(32, int(4 * total_mib / primaries) + 1)
            cluster = stack.enter_context(LocalCluster(primaries=primaries,
                                                       maxmemory=f"{per_node}mb"))
            server = cluster.nodes[0]
        else:
            per_node = int(4 * total_mib) + 1
            server = stack.enter_context(LocalServer(maxmemory=f"{per_node}mb"))
        # (a filler value, with the query buffer that receives it, must fit a node's memory)
        fill_until_evicting(server.url, min(16 * MIB, per_node * MIB // 8),
                            cluster=bool(primaries))
        url = server.url
        note = (f"local {os.path.basename(server.binary)} on loopback, full and evicting"
                + (f": a cluster of {primaries} primaries + {primaries} replicas"
                   if primaries else ""))

    def make(conns: int, workdir: str, codec: RecordCodec = CHECKSUM) -> StorageTier:
        return ValkeyTier.from_options({"url": url, "connections": conns,
                                        "key_prefix": f"kv-offload-bench-{os.getpid()}:",
                                        "timeout_s": 30.0, "refresh_interval_s": 0}, LAYOUT,
                                       codec=codec)
    make.server = server  # (the raw baseline runs on the same server)
    make.cluster = bool(primaries)
    return make, note


def _s3_factory(args, stack: contextlib.ExitStack) -> tuple[TierFactory, str]:
    from kv_offload.backends.s3 import S3Tier

    endpoint, bucket = args.endpoint_url, args.bucket
    note = f"endpoint {endpoint}, bucket {bucket}"
    if endpoint is None:
        import boto3

        from kv_offload.backends.s3.local_server import TEST_CREDENTIALS, LocalS3Server

        for name, value in TEST_CREDENTIALS.items():
            os.environ.setdefault(name, value)
        server = stack.enter_context(LocalS3Server())
        endpoint, bucket = server.endpoint_url, "kv-offload-bench"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        note = "moto's S3 server on loopback: a correctness reference, not a performance one"

    def make(conns: int, workdir: str, codec: RecordCodec = CHECKSUM) -> StorageTier:
        return S3Tier.from_options({"bucket": bucket, "endpoint_url": endpoint,
                                    "bytes_to_use": 1 << 40, "connections": conns,
                                    "prefix": f"kv-offload-bench-{os.getpid()}/",
                                    "timeout_s": 60.0, "refresh_interval_s": 0}, LAYOUT,
                                   codec=codec)
    return make, note


def _module_factory(args) -> tuple[TierFactory, str]:
    """A third-party tier, checked and opened as the connector does."""
    from kv_offload.backends import tier_class

    try:
        options = json.loads(args.tier_options or "{}")
    except json.JSONDecodeError as e:
        raise BenchArgumentError(f"--tier-options must be a JSON object: {e}") from None
    if not isinstance(options, dict):
        raise BenchArgumentError(f"--tier-options must be a JSON object, got {options!r}")
    cls = tier_class(args.tier)
    cls.check_options(options)

    def make(conns: int, workdir: str) -> StorageTier:
        return cls.from_options(options, LAYOUT)
    return make, f"{args.tier} with options {options}"
