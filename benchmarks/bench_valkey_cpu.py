"""Where the Valkey tier's throughput goes: CPU seconds per GB, client and server apart.

`kv-offload bench --tier valkey` reports GB/s; on a machine with few cores shared with
other jobs that number says more about the machine than about the tier. This script moves
``--total-mib`` of 4 MiB values (``--value-kib``) through a `ValkeyTier` on a loopback
``redis-server`` (filled until it evicts, as the bench does), store then load, and measures
for each direction: wall GB/s, the CPU seconds the client process (all its threads) and the
server process spent per GB, and the same for ``redis-benchmark`` (a C client) on the same
server. ``cores needed for 1 GB/s`` = (client + server CPU-s per GB): what the machine
must give these two processes, whatever else runs, for 1 GB/s. ``--cluster N``: the same on a
loopback cluster of N primaries + N replicas (server CPU: every node, replication included;
``redis-benchmark --cluster``).

    python benchmarks/bench_valkey_cpu.py --connections 1 4 --runs 3 --json valkey-cpu.json
    python benchmarks/bench_valkey_cpu.py --cluster 3 --connections 1 4 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import time

import torch

from kv_offload.backends.valkey import ValkeyTier
from kv_offload.backends.valkey.local_cluster import LocalCluster
from kv_offload.backends.valkey.local_server import LocalServer
from kv_offload.tools.bench_stores import fill_until_evicting
from kv_offload.tools.bench_valkey_server import benchmark_binary

TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_job(tier: ValkeyTier, job: int) -> bool:
    while True:
        for result in tier.poll():
            if result.job_id == job:
                return all(result.succeeded)
        time.sleep(0.0005)


def servers_cpu_s(nodes: list[LocalServer]) -> float:
    return sum(proc_cpu_s(node.process.pid) for node in nodes)


def measure_tier(nodes: list[LocalServer], value_bytes: int, total: int, conns: int,
                 run: int) -> dict:
    tier = ValkeyTier.from_options({"url": nodes[0].url, "key_prefix": f"cpu{run}-{conns}:",
                                    "connections": conns, "refresh_interval_s": 0,
                                    "keyspace_events": False}, "cpu-bench")
    count = max(4, total // value_bytes)
    values = [torch.randint(0, 256, (value_bytes,), dtype=torch.uint8) for _ in range(4)]
    keys = [os.urandom(16) for _ in range(count)]
    targets = torch.ones(count, value_bytes, dtype=torch.uint8)  # (touched: host tier slots)
    out = {}
    for op in ("store", "load"):
        bufs = [values[i % 4] if op == "store" else targets[i] for i in range(count)]
        c0, s0, t0 = self_cpu_s(), servers_cpu_s(nodes), time.perf_counter()
        ok = True
        for i in range(0, count, 4):  # jobs of 4 values, as the bench
            submit = tier.submit_write if op == "store" else tier.submit_read
            ok &= wait_job(tier, submit(keys[i:i + 4], bufs[i:i + 4]))
        wall = time.perf_counter() - t0
        gb = count * value_bytes / 1e9
        out[op] = {"gbps": gb / wall, "client_cpu_s_per_gb": (self_cpu_s() - c0) / gb,
                   "server_cpu_s_per_gb": (servers_cpu_s(nodes) - s0) / gb, "ok": ok}
    tier.close()
    return out


def measure_raw(nodes: list[LocalServer], value_bytes: int, total: int, conns: int,
                cluster: bool) -> dict:
    count = max(4 * conns, total // value_bytes)
    out = {}
    for op in ("set", "get"):
        c0, s0, t0 = children_cpu_s(), servers_cpu_s(nodes), time.perf_counter()
        subprocess.run([benchmark_binary(), "-p", str(nodes[0].port), "-t", op, "-d",
                        str(value_bytes), "-n", str(count), "-c", str(conns), "-r",
                        str(count), "-q", *(["--cluster"] if cluster else [])],
                       capture_output=True, check=True, timeout=600)
        wall = time.perf_counter() - t0
        gb = count * value_bytes / 1e9
        out["store" if op == "set" else "load"] = {
            "gbps": gb / wall, "client_cpu_s_per_gb": (children_cpu_s() - c0) / gb,
            "server_cpu_s_per_gb": (servers_cpu_s(nodes) - s0) / gb}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--value-kib", type=int, default=4096)
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cluster", type=int, default=0,
                        help="a loopback cluster of this many primaries (+ one replica each)")
    parser.add_argument("--json")
    args = parser.parse_args()
    value, total = args.value_kib << 10, args.total_mib << 20
    rows: dict[tuple, list[dict]] = {}
    cluster = bool(args.cluster)
    with (LocalCluster(primaries=args.cluster, maxmemory="1gb") if cluster
          else LocalServer(maxmemory="1gb")) as started:
        nodes = started.nodes if cluster else [started]
        fill_until_evicting(nodes[0].url, cluster=cluster)
        for run in range(args.runs):
            for conns in args.connections:  # (tier and raw alternate: the same load)
                rows.setdefault(("valkey tier", conns), []).append(
                    measure_tier(nodes, value, total, conns, run))
                rows.setdefault(("redis-benchmark", conns), []).append(
                    measure_raw(nodes, value, total, conns, cluster))
    where = f"a cluster of {args.cluster} primaries + replicas" if cluster else "one server"
    print(f"{args.value_kib} KiB values, {args.total_mib} MiB per direction, medians of "
          f"{args.runs} runs, {where}; load average {os.getloadavg()}")
    print(f"{'client':16} {'conns':>5} {'dir':6} {'GB/s':>6} {'client CPU-s/GB':>16} "
          f"{'server CPU-s/GB':>16} {'cores for 1 GB/s':>17}")
    summary = []
    for (client, conns), runs in rows.items():
        for op in ("store", "load"):
            med = {k: statistics.median(r[op][k] for r in runs)
                   for k in ("gbps", "client_cpu_s_per_gb", "server_cpu_s_per_gb")}
            cores = med["client_cpu_s_per_gb"] + med["server_cpu_s_per_gb"]
            print(f"{client:16} {conns:>5} {op:6} {med['gbps']:>6.2f} "
                  f"{med['client_cpu_s_per_gb']:>16.2f} {med['server_cpu_s_per_gb']:>16.2f} "
                  f"{cores:>17.2f}")
            summary.append({"client": client, "connections": conns, "direction": op,
                            **med, "cores_for_1gbps": cores, "runs": [r[op] for r in runs]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": os.getloadavg(), "rows": summary}, f, indent=2)


if __name__ == "__main__":
    main()
