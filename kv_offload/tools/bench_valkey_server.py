"""The server alone: ``redis-benchmark`` / ``valkey-benchmark`` as the raw baseline of the
Valkey tier's benchmark (a C client, no Python, no headers or checksums).

It runs ``SET`` then ``GET`` of ``count`` values of one size over ``conns`` connections, on a
server the benchmark started itself (it writes keys named ``key:*``: never point it at a
server that holds anything else). Its GB/s tell what this machine's loopback and server can
do, so the tier's numbers can be read against them.
"""

from __future__ import annotations

import re
import subprocess

from kv_offload.backends.common.local_process import first_on_path

BINARIES = ("valkey-benchmark", "redis-benchmark")
_SUMMARY = re.compile(r"====== (SET|GET) ======.*?throughput summary: ([\d.]+) requests per "
                      r"second", re.S)


def benchmark_binary() -> str | None:
    return first_on_path(BINARIES)


def server_alone_gbps(binary: str, port: int, value_bytes: int, conns: int,
                      count: int, cluster: bool = False) -> tuple[float, float]:
    """(SET GB/s, GET GB/s) of ``count`` values of ``value_bytes`` over ``conns`` clients
    (``cluster``: ``--cluster``, the clients spread over every primary)."""
    requests = max(count, 4 * conns)
    out = subprocess.run(
        [binary, "-h", "127.0.0.1", "-p", str(port), "-t", "set,get", "-d", str(value_bytes),
         "-n", str(requests), "-c", str(conns), "-r", str(count),
         *(["--cluster"] if cluster else [])],
        capture_output=True, text=True, timeout=600, check=True).stdout
    rates = {op: float(rate) for op, rate in _SUMMARY.findall(out.replace("\r", "\n"))}
    if set(rates) != {"SET", "GET"}:
        raise RuntimeError(f"could not read {binary}'s throughput from: {out[-500:]}")
    return rates["SET"] * value_bytes / 1e9, rates["GET"] * value_bytes / 1e9
