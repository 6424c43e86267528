"""The `kv-offload` command: `demo` the connector, `inspect` canonical views, `bench` backends,
`serve-check` a running vLLM server.

Every subcommand prints its table(s) with `report.Table`, writes `--json PATH` as the same
envelope (`report.envelope`: command, version, statistic, results; `--json -` writes it to
stdout and the tables to stderr), shows progress of long runs on stderr, and exits 0 when
everything checked out, 1 on any mismatch or failed key, 2 on arguments it cannot honour.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kv-offload", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    from kv_offload.tools.demo import add_demo_arguments, run_demo

    demo = commands.add_parser("demo", help="vLLM with the connector: cold, CPU-tier, disk passes")
    add_demo_arguments(demo)
    demo.set_defaults(run=run_demo)

    from kv_offload.tools.inspect_cmd import add_inspect_arguments, run_inspect

    inspect = commands.add_parser("inspect", help="canonicalise the example models, show pages")
    add_inspect_arguments(inspect)
    inspect.set_defaults(run=run_inspect)

    from kv_offload.tools.serve_check import add_serve_check_arguments, run_serve_check

    serve_check = commands.add_parser(
        "serve-check", help="verify a running vLLM server: hits from kv-offload, same outputs")
    add_serve_check_arguments(serve_check)
    serve_check.set_defaults(run=run_serve_check)

    from kv_offload.tools.bench import add_bench_arguments, run_bench

    bench = commands.add_parser("bench", help="measure store/load throughput of a backend")
    add_bench_arguments(bench)
    bench.set_defaults(run=run_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
