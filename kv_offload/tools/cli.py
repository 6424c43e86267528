"""The `kv-offload` command: `demo` the connector, `inspect` canonical views, `bench` tiers,
`serve-check` a running vLLM server, `secret new` a secret file for a shared store, `proxy`
requests to prefill and decode servers.

Every subcommand that measures or checks (all but `secret`, which writes one file and
prints the config line for it: `secret_cmd`, and `proxy`, which serves until interrupted
and logs one line per request: `proxy_cmd`) prints its table(s) with `report.Table`, writes
`--json PATH` as the same envelope (`report.envelope`: command, version, statistic, results;
`--json -` writes it to stdout and the tables to stderr), shows progress of long runs on
stderr, and exits 0 when everything checked out, 1 on any mismatch or failed key, 2 on
arguments it cannot honour.

The help a user reads (`DESCRIPTION`, each subcommand's description) says what the command
does and promises, never how this package is built: the module docstrings are for developers.
Each subcommand's parser is a `report.SubcommandParser`, so a flag it does not know is
reported with that subcommand's usage.
"""

from __future__ import annotations

import argparse
import sys

import kv_offload
from kv_offload.tools.report import SubcommandParser

DESCRIPTION = """\
Offload the KV cache of vLLM to host memory, disk and shared stores: see it work (demo),
look at what would be offloaded (inspect), measure the tiers (bench), check a running
server (serve-check), check a configuration without starting vLLM (check-config), create
the secret file a shared store needs (secret new), split requests between prefill and
decode servers (proxy).

Every subcommand but secret and proxy prints a table; --json PATH also writes the results
as JSON ('-': the JSON to stdout, the table to stderr). Progress goes to stderr. Exit
status: 0 when everything checked out, 1 on any mismatched output or failed key, 2 on bad
arguments.
Run 'kv-offload COMMAND --help' for a command's flags."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kv-offload", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {kv_offload.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=SubcommandParser)

    from kv_offload.tools import demo as demo_cmd

    demo = commands.add_parser(
        "demo", help="vLLM with the connector: cold, CPU-tier, disk passes",
        description=demo_cmd.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo_cmd.add_demo_arguments(demo)
    demo.set_defaults(run=demo_cmd.run_demo)

    from kv_offload.tools.inspect_cmd import add_inspect_arguments, run_inspect

    inspect = commands.add_parser(
        "inspect", help="canonicalise the example models, show pages",
        description="Lay out each example model's KV cache as vLLM would, and print per model "
                    "its cache groups, unique tensors, page sizes and the bytes offloaded per "
                    "block. Needs no vLLM.")
    add_inspect_arguments(inspect)
    inspect.set_defaults(run=run_inspect)

    from kv_offload.tools.serve_check import add_serve_check_arguments, run_serve_check

    serve_check = commands.add_parser(
        "serve-check", help="verify a running vLLM server: hits from kv-offload, same outputs",
        description="Send prompts to a running vLLM server twice (around a reset of vLLM's "
                    "own prefix cache) and check that the second time is served from "
                    "kv-offload with the same outputs.")
    add_serve_check_arguments(serve_check)
    serve_check.set_defaults(run=run_serve_check)

    from kv_offload.tools.bench import add_bench_arguments, run_bench

    bench = commands.add_parser(
        "bench", help="measure store/load throughput of a tier",
        description="Store and load throughput of one tier against a baseline measured in "
                    "the same run (a plain copy, raw disk I/O, or the disk tier), every "
                    "byte checked.")
    add_bench_arguments(bench)
    bench.set_defaults(run=run_bench)

    from kv_offload.tools import check_config_cmd

    check_config = commands.add_parser(
        "check-config", help="run every start-up check of a --kv-transfer-config, no vLLM",
        description=check_config_cmd.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    check_config_cmd.add_check_config_arguments(check_config)
    check_config.set_defaults(run=check_config_cmd.run_check_config)

    from kv_offload.tools.secret_cmd import add_secret_arguments

    secret = commands.add_parser(
        "secret", help="create the secret file a shared store (valkey, s3) needs",
        description="Make the secret_file that engines sharing a Valkey/Redis server or an "
                    "S3 bucket authenticate their stored records with.")
    add_secret_arguments(secret)

    from kv_offload.tools import proxy_cmd

    proxy = commands.add_parser(
        "proxy", help="send each request to a prefill server, then to a decode server",
        description=proxy_cmd.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    proxy_cmd.add_proxy_arguments(proxy)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
