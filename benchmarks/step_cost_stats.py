"""Summaries of bench_step_cost.py's step records: percentiles per side and per call.

A phase (the first steps while the inventory streams in, or the steady state) is summarised
as p50/p99/max/mean/sum per side (scheduler, worker, ipc), wall and CPU, per call, plus
every step's wall cost per side (`samples_ms`, the CDF that `--plot` draws). Apart from the
benchmark so that it stays one concern: driving the simulated engine.
"""

from __future__ import annotations

import numpy as np
from step_cost_engine import SCHEDULER_CALLS, WORKER_CALLS


def phase_summary(records) -> dict:
    if not records:
        return {}
    sides = {"scheduler": SCHEDULER_CALLS, "worker": WORKER_CALLS, "ipc": ("ipc",)}
    summary = {"steps": len(records), "step_range": [records[0].step, records[-1].step]}
    # Every step's cost per side (wall, ms): the CDF of --plot.
    summary["samples_ms"] = {side: [r.side_ns(calls) / 1e6 for r in records]
                             for side, calls in sides.items()}
    for side, calls in sides.items():
        summary[side] = stats_ms([r.side_ns(calls) for r in records])
        summary[f"{side}_cpu"] = stats_ms([r.side_ns(calls, cpu=True) for r in records])
    summary["calls"] = {name: stats_ms([r.ns.get(name, 0) for r in records])
                        for name in SCHEDULER_CALLS + WORKER_CALLS}
    summary["calls_cpu"] = {name: stats_ms([r.cpu_ns.get(name, 0) for r in records])
                            for name in SCHEDULER_CALLS + WORKER_CALLS}
    summary["report_keys"] = stats([r.report_keys for r in records])
    summary["gc"] = {"pause_per_step": stats_ms([r.gc_ns for r in records]),
                     "pause_cpu_per_step": stats_ms([r.gc_cpu_ns for r in records]),
                     "full_collections": sum(r.gc_full for r in records)}
    for name in ("scheduled_tokens", "stored_blocks", "loads", "lookups"):
        summary[name] = float(np.mean([getattr(r, name) for r in records]))
    return summary


def stats(values) -> dict:
    a = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max()), "mean": float(a.mean()), "sum": float(a.sum())}


def stats_ms(ns_values) -> dict:
    out = {k: v / 1e6 for k, v in stats(ns_values).items()}
    out["over_1ms"] = int(sum(v > 1e6 for v in ns_values))
    return out
