"""The tables `bench_step_cost.py` prints: per-step cost by phase and side, per call, the
store planning of long prefills, and trees compared side by side."""

from __future__ import annotations


def print_steps(result: dict) -> None:
    steps = result["steps"]
    print(f"\n[{result['label']}] per-step cost (ms), {steps['keys']:,} keys on disk, "
          f"{steps['requests']} requests, model {steps['model']}, forward {steps['forward_ms']} "
          f"ms ({steps['steps']} steps in {steps['wall_s']:.1f} s); wall = what the engine "
          f"thread waited, cpu = its CPU time")
    header = f"{'phase':13} {'side':9} {'steps':>5} {'wall p50':>9} {'p99':>8} {'max':>8} " \
             f"{'>1ms':>5} {'cpu p50':>8} {'p99':>8} {'max':>8} {'sum':>9}"
    print(header + "\n" + "-" * len(header))
    for phase in ("first_steps", "steady_state"):
        summary = steps[phase]
        for side in ("scheduler", "worker", "ipc"):
            w, c = summary[side], summary[f"{side}_cpu"]
            print(f"{phase:13} {side:9} {summary['steps']:>5} {w['p50']:>9.3f} "
                  f"{w['p99']:>8.3f} {w['max']:>8.1f} {w['over_1ms']:>5} {c['p50']:>8.3f} "
                  f"{c['p99']:>8.3f} {c['max']:>8.1f} {c['sum']:>9.1f}")
    if steps.get("shared"):
        from step_cost_shared import print_shared

        print_shared(steps)
    for phase in ("first_steps", "steady_state"):
        summary = steps[phase]
        print(f"  {phase}: report keys p50 {summary['report_keys']['p50']:.0f} max "
              f"{summary['report_keys']['max']:.0f}; per step: {summary['lookups']:.1f} "
              f"lookups, {summary['loads']:.2f} loads, {summary['stored_blocks']:.0f} blocks "
              f"stored, {summary['scheduled_tokens']:.0f} tokens; garbage collector: "
              f"{summary['gc']['full_collections']} full collections, pauses "
              f"{summary['gc']['pause_per_step']['sum']:.0f} ms in all (cpu "
              f"{summary['gc']['pause_cpu_per_step']['sum']:.0f}), at most "
              f"{summary['gc']['pause_per_step']['max']:.0f} ms in one step (cpu "
              f"{summary['gc']['pause_cpu_per_step']['max']:.0f})")


def print_calls(result: dict) -> None:
    print(f"\n[{result['label']}] per call, wall ms p50 / p99 / max (cpu p99)")
    for phase in ("first_steps", "steady_state"):
        calls, cpu = result["steps"][phase]["calls"], result["steps"][phase]["calls_cpu"]
        print(f"  {phase}: " + ", ".join(
            f"{name} {c['p50']:.3f}/{c['p99']:.3f}/{c['max']:.1f} ({cpu[name]['p99']:.3f})"
            for name, c in calls.items() if c["max"] > 0))


def print_prefills(result: dict) -> None:
    print(f"\n[{result['label']}] store planning of a long prefill (ms)")
    header = f"{'case':28} {'blocks':>7} {'prefill':>9} {'(cpu)':>8} {'max step':>9} " \
             f"{'decode':>8} {'lookup':>7} {'reports':>8}"
    print(header + "\n" + "-" * len(header))
    for r in result["prefill"]:
        print(f"{r['case']:28} {r['blocks_planned']:>7} {r['prefill_planning_ms']:>9.2f} "
              f"{r['prefill_planning_cpu_ms']:>8.2f} {r['max_step_ms']:>9.2f} "
              f"{r['decode_planning_ms']:>8.2f} {r['lookup_ms']:>7.2f} "
              f"{r['apply_reports_ms']:>8.2f}")


def print_comparison(results: list[dict]) -> None:
    names = [r["label"] for r in results]
    print("\n" + "; ".join(f"[{i}] {name}" for i, name in enumerate(names)) +
          "; ratio = [0] / [i]")
    header = f"{'measure (ms)':50}" + "".join(f"{f'[{i}]':>10}" for i in range(len(results))) \
        + "".join(f"{f'[0]/[{i}]':>9}" for i in range(1, len(results)))
    print(header + "\n" + "-" * len(header))
    for name, values in comparison_rows(results):
        cells = "".join(f"{v:>10.3f}" for v in values)
        ratios = "".join(f"{values[0] / v:>9.1f}" if v else f"{'n/a':>9}" for v in values[1:])
        print(f"{name:50}{cells}{ratios}")


def comparison_rows(results: list[dict]) -> list[tuple[str, list[float]]]:
    rows = []
    if all("steps" in r for r in results):
        for phase, label in (("first_steps", "first steps"), ("steady_state", "steady")):
            for side in ("scheduler", "worker"):
                for kind, suffix in ((side, ""), (f"{side}_cpu", " cpu")):
                    for stat in ("p50", "p99", "max", "sum"):
                        rows.append((f"{label} {side}{suffix} {stat}",
                                     [r["steps"][phase][kind][stat] for r in results]))
    if all("prefill" in r for r in results):
        for i, case in enumerate(results[0]["prefill"]):
            for key, label in (("prefill_planning_ms", "total"),
                               ("prefill_planning_cpu_ms", "total cpu"),
                               ("max_step_ms", "max step")):
                rows.append((f"prefill planning {label}, {case['case']}",
                             [r["prefill"][i][key] for r in results]))
    return rows
