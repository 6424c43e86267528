"""Figures of the benchmarks' JSON: what `--plot PATH` writes next to `--json PATH`.

One function per figure, each taking the JSON document(s) its benchmark writes (so a figure
can be redrawn later from saved JSON: ``python -m kv_offload.tools.plots KIND JSON... -o PNG``):

- `ttft_by_source`: time to first token by where the prompt's KV came from (recompute,
  vLLM's own hit, our host tier, our disk tier), one panel per model
  (`benchmarks/bench_ttft.py`, one document per model).
- `zipf_hits`: tokens served from our tiers against an ideal LRU cache as the disk budget
  grows (`benchmarks/bench_zipf.py --disk-fraction F...`).
- `step_cost_cdf`: the distribution of what our code adds to an engine step, scheduler and
  worker side, per number of stored keys (`benchmarks/bench_step_cost.py --keys N...`).
- `tier_throughput`: store/load GB/s by value size, one line per tier and connection count
  (`kv-offload bench --tier filesystem|valkey|s3|module:Class`).

matplotlib is an optional extra (`plots`, also in `dev`): `require_matplotlib` turns its
absence into a `ConfigError` naming the extra, raised before a benchmark starts
(`plot_path`, the argparse type of every `--plot` flag). Figures are drawn on a bare
`matplotlib.figure.Figure`, never pyplot: no global state, no display backend needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kv_offload.errors import ConfigError
from kv_offload.tools.report import output_path

# Said on every figure: the numbers come from one run on a shared, loaded machine.
NOISE_NOTE = "one run on a shared 2-core CPU machine: noisy"
# bench_ttft's passes, in the order shown, and what a reader calls them.
TTFT_SOURCES = {"cold_no_connector": "recompute", "vllm_hit": "vLLM's own hit",
                "host": "kv-offload host", "disk": "kv-offload disk"}


def run_note() -> str:
    """`NOISE_NOTE` with the machine's load now (what a figure drawn right after its run says)."""
    return f"{NOISE_NOTE}; 1-min load average {os.getloadavg()[0]:.1f} at the end"


def _plain_log_axis(axis, decades: bool = False) -> None:
    """Log-scale ticks written as plain numbers (0.25, 1, 4), not powers; `decades`: ticks at
    1, 2 and 5 of every decade (a range of one decade still gets several)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    if decades:
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'kv-offload[plots]'") from None


def plot_path(text: str) -> str:
    """An argparse type: a writable PNG path, with matplotlib installed (else exit 2)."""
    path = output_path(text)
    if path == "-":
        raise argparse.ArgumentTypeError("a figure needs a file path, not '-'")
    try:
        require_matplotlib()
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return path


def _figure(ncols: int, title: str, note: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(7.0, 4.8 * ncols), 4.2), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    fig.suptitle(f"{title}\n({note})", fontsize=10)
    return fig, axes


def ttft_by_source(documents: Sequence[dict[str, Any]], path: str | Path,
                   note: str = NOISE_NOTE) -> None:
    fig, axes = _figure(len(documents), "Time to first token by where the KV cache came from",
                        note)
    for ax, doc in zip(axes, documents):
        passes = doc["passes"]
        names = [n for n in TTFT_SOURCES if n in passes]
        ms = [passes[n]["median_ttft_wall_s"] * 1e3 for n in names]
        bars = ax.bar([TTFT_SOURCES[n] for n in names], ms,
                      color=["#999999", "#4c72b0", "#55a868", "#dd8452"][:len(names)])
        ax.bar_label(bars, fmt="%.0f ms", fontsize=8)
        model = doc.get("model", {})
        ax.set_title(f"{model.get('arch', '?')}: {doc['num_prompts']} prompts x "
                     f"{doc['prompt_tokens']} tokens (median)", fontsize=9)
        ax.set_ylabel("TTFT, ms (log)")
        ax.set_yscale("log")
        ax.set_ylim(10, max(ms) * 2)  # (room above the tallest bar for its label)
        _plain_log_axis(ax.yaxis, decades=True)
        ax.tick_params(axis="x", labelsize=8)
    fig.savefig(path, dpi=110)


def zipf_hits(documents: Sequence[dict[str, Any]], path: str | Path,
              note: str = NOISE_NOTE) -> None:
    runs = sorted(documents, key=lambda d: d["sizes"]["disk_blocks"])
    fig, (ax,) = _figure(1, "Tokens served from cache on a Zipf trace vs the ideal LRU", note)
    mib = [d["sizes"]["fs_bytes_to_use"] / 2**20 for d in runs]
    ax.plot(mib, [d["served_tokens"] for d in runs], "o-", label="kv-offload (host + disk)")
    ax.plot(mib, [d["ideal_disk_tokens"] for d in runs], "s--",
            label="ideal LRU of the disk budget")
    ax.plot(mib, [d["ideal_host_tokens"] for d in runs], ":", color="gray",
            label="ideal LRU of the host budget")
    ax.set_xlabel("disk budget, MiB")
    ax.set_ylabel("prompt tokens served from cache")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def step_cost_cdf(results: Sequence[dict[str, Any]], path: str | Path,
                  note: str = NOISE_NOTE) -> None:
    import numpy as np

    fig, axes = _figure(2, "What kv-offload adds to one engine step (steady state)", note)
    for ax, side in zip(axes, ("scheduler", "worker")):
        for result in results:
            steps = result["steps"]
            ms = np.sort(steps["steady_state"]["samples_ms"][side])
            share = np.arange(1, len(ms) + 1) / len(ms)
            keys = steps.get("stored_keys", steps["keys"])  # (a small run stores some anyway)
            ax.step(ms, share, where="post", label=f"{keys:,} stored keys")
        ax.axvline(1.0, color="gray", linestyle=":", label="goal: p99 < 1 ms")
        ax.set_xscale("log")
        _plain_log_axis(ax.xaxis, decades=True)
        ax.set_xlabel(f"{side} side, ms per step (wall, log)")
        ax.set_ylabel("share of steps")
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def tier_throughput(result: dict[str, Any], path: str | Path, note: str = NOISE_NOTE) -> None:
    fig, axes = _figure(2, "Storage tier throughput by value size and connections", note)
    cells = result["cells"]
    tiers = list(dict.fromkeys(c["tier"] for c in cells))
    conns = sorted({c["connections"] for c in cells})
    colors = dict(zip(conns, ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2"] * 4))
    styles = dict(zip(tiers, ["-", "--", ":", "-."] * 2))  # the tier solid, baselines dashed
    for ax, figure in zip(axes, ("store_gbps", "load_gbps")):
        for tier in tiers:
            for n in conns:
                line = sorted((c["value_mib"], c[figure]) for c in cells
                              if c["tier"] == tier and c["connections"] == n)
                if line:
                    ax.plot([v for v, _ in line], [g for _, g in line], styles[tier],
                            marker="o", color=colors[n], label=f"{tier}, {n} conn.")
        ax.set_xscale("log", base=2)
        _plain_log_axis(ax.xaxis)
        ax.set_xlabel("value size, MiB (log)")
        ax.set_ylabel(f"{figure.split('_')[0]} GB/s (best of {result.get('repeats', '?')})")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)


def _results(document: dict[str, Any]) -> Any:
    """A `report.envelope`'s results, or a benchmark's own document as it is."""
    return document["results"] if {"command", "results"} <= set(document) else document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kv_offload.tools.plots",
                                     description="Redraw a benchmark's figure from its JSON.")
    parser.add_argument("kind", choices=("ttft", "zipf", "step-cost", "tiers"))
    parser.add_argument("json", nargs="+", type=Path, help="the benchmark's JSON file(s)")
    parser.add_argument("-o", "--output", required=True, type=plot_path, help="the PNG")
    parser.add_argument("--note", default=NOISE_NOTE, help="the line under the title")
    args = parser.parse_args(argv)
    docs = [_results(json.loads(p.read_text())) for p in args.json]
    if args.kind == "ttft":
        ttft_by_source(docs, args.output, args.note)
    elif args.kind == "zipf":
        zipf_hits([run for d in docs for run in d.get("runs", [d])], args.output, args.note)
    elif args.kind == "step-cost":
        step_cost_cdf([r for d in docs for r in d["results"]], args.output, args.note)
    else:
        tier_throughput(docs[0], args.output, args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
