"""`kv-offload serve-check URL`: the command line of `kv_offload.serving.check`.

Prints one row per check and exits 0 when every check passed, 1 when one failed, 2 on bad
arguments. Needs only the client side: `openai`, `httpx` and `prometheus_client` (the
`serve` extra, or the `vllm` one, which brings them).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kv_offload.errors import ServeCheckInputError, ServingError
from kv_offload.serving.check import CheckOptions, CheckReport, run_check
from kv_offload.serving.client import api_roots
from kv_offload.tools.report import Table, emit, envelope, output_path


def add_serve_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model to ask for (default: the first one listed)")
    parser.add_argument("--prompts", type=int, default=3,
                        help="number of prompts (default 3)")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="tokens per prompt (default 512)")
    parser.add_argument("--max-tokens", type=int, default=8,
                        help="tokens generated per prompt (default 8)")
    parser.add_argument("--logprobs", type=int, default=5,
                        help="top logprobs compared per generated token (default 5)")
    parser.add_argument("--logprob-tolerance", type=float, default=0.0,
                        help="largest logprob difference accepted (default 0: bit-identical, "
                             "what the CPU build gives; GPU kernels may differ slightly "
                             "between a full prefill and one continuing a cached prefix)")
    parser.add_argument("--seed", type=int, help="seed of the prompts (default: random)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--record", type=output_path, metavar="PATH",
                      help="also write the prompts and the cold-pass outputs to PATH")
    mode.add_argument("--replay", type=Path, metavar="PATH",
                      help="no cold pass: send the prompts recorded in PATH and compare with "
                           "the recorded outputs (e.g. after a restart over the same disk "
                           "directory)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                        help="API key, if the server wants one (default $OPENAI_API_KEY)")
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="seconds allowed per request (default 120)")
    parser.add_argument("--json", metavar="PATH", type=output_path,
                        help="also write the report here ('-': stdout)")


def _options(args: argparse.Namespace) -> CheckOptions:
    try:
        api_roots(args.url)  # the URL's form, before any request
    except ServingError as e:
        raise ServeCheckInputError(str(e)) from None
    for name in ("prompts", "prompt_tokens", "max_tokens", "logprobs"):
        if getattr(args, name) < 1:
            raise ServeCheckInputError(f"--{name.replace('_', '-')} must be at least 1, got "
                                       f"{getattr(args, name)}")
    if args.logprob_tolerance < 0:
        raise ServeCheckInputError(f"--logprob-tolerance must be >= 0, got "
                                   f"{args.logprob_tolerance}")
    if args.timeout_s <= 0:
        raise ServeCheckInputError(f"--timeout-s must be positive, got {args.timeout_s}")
    return CheckOptions(
        url=args.url, model=args.model, prompts=args.prompts, prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens, logprobs=args.logprobs,
        logprob_tolerance=args.logprob_tolerance, seed=args.seed,
        record=None if args.record is None else Path(args.record),
        replay=args.replay, api_key=args.api_key, timeout_s=args.timeout_s,
    )


def report_table(report: CheckReport) -> Table:
    marks = {True: "ok", False: "FAILED", None: "skipped"}
    table = Table(f"kv-offload serve-check {report.url}", ("check", "result", "evidence"))
    for c in report.checks:
        table.add(c.name, marks[c.passed], c.detail)
    verdict = "PASSED" if report.passed else "FAILED"
    table.notes.append(f"{verdict}: {sum(c.passed is True for c in report.checks)} checks "
                       f"passed, {sum(c.passed is False for c in report.checks)} failed")
    return table


def run_serve_check(args: argparse.Namespace) -> int:
    try:
        report = run_check(_options(args))
    except ServeCheckInputError as e:
        print(f"kv-offload serve-check: {e}", file=sys.stderr)
        return 2
    emit([report_table(report)], envelope("serve-check", report.to_json()), args.json)
    return 0 if report.passed else 1
