"""The `kv-offload` command line as a new user first tries it: `--version`, a mistyped URL, an
output path in a missing folder, a model named as another subcommand names it, an unknown
flag, `--help`, and a demo whose times are medians of repeats.

Each check runs the real command in a subprocess (or its real parser), never more than a
few seconds: nothing here starts vLLM.
"""

from __future__ import annotations

import pytest

import kv_offload
from kv_offload.testing.example_models import EXAMPLE_MODELS
from kv_offload.tools.cli import build_parser
from kv_offload.tools.demo import MODELS, PassResult, _pass_results, _table

from unit.tools.test_cli import kv_offload_cli

SUBCOMMANDS = ("demo", "inspect", "bench", "serve-check")


def test_version_prints_the_package_version_and_exits_0(tmp_path):
    proc = kv_offload_cli("--version", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"kv-offload {kv_offload.__version__}"


def test_serve_check_of_a_url_without_http_exits_2_with_the_reason_and_no_traceback(tmp_path):
    pytest.importorskip("openai")
    proc = kv_offload_cli("serve-check", "notaurl", "--json", "-", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "'notaurl' must start with http:// or https://" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("args", [
    ["inspect", "--model", "gemma3", "--json"],
    ["bench", "--tier", "host", "--page-kib", "4", "--batch-mib", "1", "--json"],
    ["serve-check", "http://127.0.0.1:9", "--json"],
    ["serve-check", "http://127.0.0.1:9", "--record"],
    ["demo", "--model-size", "tiny", "--json"],
])
def test_an_output_path_in_a_missing_folder_is_refused_before_anything_runs(args, tmp_path):
    missing = tmp_path / "nonexistent" / "x.json"
    # (a demo that ran first would build a model and start vLLM: far past this timeout)
    proc = kv_offload_cli(*args, str(missing), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"the folder '{missing.parent}' does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_demo_names_its_models_as_inspect_and_bench_do():
    assert set(MODELS) - {"llama"} <= set(EXAMPLE_MODELS)  # llama: the demo's own small one
    assert build_parser().parse_args(["demo", "--model", "qwen3-next"]).model == "qwen3-next"
    for name in EXAMPLE_MODELS:
        assert build_parser().parse_args(["inspect", "--model", name]).model == [name]


def test_the_old_demo_model_spelling_still_works_with_a_deprecation_note(capsys):
    assert build_parser().parse_args(["demo", "--model", "qwen3_next"]).model == "qwen3-next"
    assert "--model qwen3_next is deprecated, use --model qwen3-next" in capsys.readouterr().err


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_an_unknown_flag_after_a_subcommand_shows_that_subcommands_usage(command, tmp_path):
    url = ["http://127.0.0.1:9"] if command == "serve-check" else []
    proc = kv_offload_cli(command, *url, "--bogus", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"usage: kv-offload {command} ")
    assert f"kv-offload {command}: error: unrecognized arguments: --bogus" in proc.stderr


@pytest.mark.parametrize("command", ["", *SUBCOMMANDS, "secret", "secret new", "proxy"])
def test_help_speaks_of_what_the_command_does_not_of_its_modules(command, tmp_path):
    proc = kv_offload_cli(*command.split(), "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "usage: kv-offload" in proc.stdout
    for internal in ("report.", "kv_offload.tools", "`", "--child"):
        assert internal not in proc.stdout, (internal, proc.stdout)


def _pass(name: str, runs: list[tuple[float, list[int], int]]) -> dict:
    return {"name": name, "runs": [
        {"seconds": s, "requests": [{"prompt_len": 64, "num_cached_tokens": c,
                                     "token_ids": tokens}]}
        for s, tokens, c in runs]}


def test_the_demo_reports_the_median_of_its_repeats_and_checks_every_repeat():
    passes = [
        _pass("cold", [(2.0, [1], 0), (9.0, [2], 0), (1.0, [3], 0)]),
        _pass("host", [(0.5, [1], 32), (0.4, [2], 32), (0.1, [3], 32)]),
        # the disk pass's second repeat differs from the cold pass over the same prompts
        _pass("disk", [(0.5, [1], 32), (8.0, [9], 0), (1.0, [3], 32)]),
    ]
    results = _pass_results(passes, no_connector=False)
    assert [r.seconds for r in results] == [2.0, 0.4, 1.0]
    assert [r.samples for r in results] == [[2.0, 9.0, 1.0], [0.5, 0.4, 0.1], [0.5, 8.0, 1.0]]
    assert [r.speedup for r in results] == [1.0, 5.0, 2.0]
    assert [r.identical for r in results] == [True, True, False]
    assert [(r.cached_tokens, r.cached_tokens_min) for r in results] == [(0, 0), (32, 32),
                                                                         (32, 0)]


@pytest.mark.parametrize("repeats, says", [(3, "median of 3 timed runs"),
                                           (1, "one timed run per pass")])
def test_the_demo_table_says_how_many_runs_each_time_is(repeats, says):
    args = build_parser().parse_args(["demo", "--repeats", str(repeats)])
    result = PassResult("cold", "recompute", 1, 64, 0, 1.0, 1.0, True, [], [1.0] * repeats, 0)
    engine = {"vllm": "0.32.0", "device": "cpu"}
    runs = [{"engine_start_s": 1.0, "engine": engine}, {"engine_start_s": 1.0, "engine": engine}]
    text = _table([result], args, 64, runs).render()
    assert says in text
    assert ("median s" in text) == (repeats > 1)


def test_the_demo_without_the_connector_labels_every_pass_a_recompute():
    passes = [_pass(name, [(1.0, [1], 0)]) for name in ("cold", "host", "disk")]
    results = _pass_results(passes, no_connector=True)
    assert [r.source for r in results] == ["recompute", "recompute (no connector)",
                                           "recompute (no connector)"]
    assert [r.cached_tokens for r in results] == [0, 0, 0]
