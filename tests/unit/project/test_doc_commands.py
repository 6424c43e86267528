"""Every command in README.md and docs/ stays true (the marks are explained in doc_blocks.py).

Blocks marked ``run here`` are run as a reader would paste them: bash through ``bash -e``,
Python through ``python -c``, in an empty directory, with this checkout first on
``PYTHONPATH`` and a ``kv-offload`` on ``PATH`` that runs this checkout's command line.
Blocks marked ``run by`` must name test files, tests and CI scripts that exist. Every other
command block must say why it is not run here. Beyond that, every ``kv-offload ...`` line of
every bash block (run or not) must parse with the real argument parser, so a renamed flag or
model name fails here; every JSON block must parse, and a connector config must pass
``parse_config`` and the start-up ``check_config``; and the configuration keys and tier
options the pages document must be the ones the code declares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kv_offload.backends.filesystem.config import FilesystemTierConfig
from kv_offload.backends.s3.config import S3TierConfig
from kv_offload.backends.valkey.config import ValkeyTierConfig
from kv_offload.config import OffloadConfig, parse_config, parse_size
from kv_offload.store.startup_checks import check_config
from kv_offload.tools.cli import build_parser

from helpers.doc_blocks import (
    REPO,
    Block,
    all_blocks,
    expected_output,
    logical_lines,
    parse_mark,
    read_blocks,
)
from helpers.servers import new_secret_file

BLOCKS = all_blocks()
COMMANDS = [b for b in BLOCKS if b.is_command]
RUN_HERE = [b for b in COMMANDS if parse_mark(b.mark).kind == "run here"]
RUN_BY = [b for b in COMMANDS if parse_mark(b.mark).kind == "run by"]
SHELL = [b for b in COMMANDS if b.language != "python"]
JSON_BLOCKS = [b for b in BLOCKS if b.language == "json"]
_SHELL_OPERATORS = {"&&", "||", ";", "|", "&", ">", "2>&1"}


def unmarked(blocks: list[Block]) -> list[str]:
    """The command blocks that carry none of the three marks, as 'page:line'."""
    return [b.where for b in blocks if b.is_command and not parse_mark(b.mark).kind]


def missing_runners(block: Block) -> list[str]:
    """The runners a `run by` mark names that do not exist (a file, or a test in it)."""
    missing = []
    for runner in parse_mark(block.mark).runners:
        path, _, test = runner.partition("::")
        source = REPO / path
        defined = source.is_file() and (not test or re.search(
            rf"^(async )?def {re.escape(test)}\(", source.read_text(), re.MULTILINE))
        if not defined:
            missing.append(runner)
    return missing


def kv_offload_invocations(script: str) -> list[list[str]]:
    """The argument lists of every `kv-offload ...` command in a shell script."""
    found = []
    for line in logical_lines(script):
        if line.lstrip().startswith("$ "):
            line = line.lstrip()[2:]
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote: not a command line we can check
            continue
        for start, word in enumerate(words):
            if word == "kv-offload":
                args = []
                for arg in words[start + 1:]:
                    if arg in _SHELL_OPERATORS:
                        break
                    args.append(arg)
                found.append(args)
    return found


def parse_error(args: list[str]) -> str | None:
    """What the real `kv-offload` parser says against `args` (None: they parse)."""
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        try:
            build_parser().parse_args(args)
        except SystemExit as exit_:
            return None if exit_.code == 0 else stderr.getvalue().strip()
    return None


def run_block(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    """Run a `run here` block as a reader would, with this checkout's code."""
    bin_dir = cwd / ".bin"
    bin_dir.mkdir()
    shim = bin_dir / "kv-offload"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kv_offload.tools.cli "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ,
           "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH")]
                                         if p)}
    command = [sys.executable, "-c", block.text] if block.language == "python" \
        else ["bash", "-e", "-o", "pipefail", "-c", block.text]
    return subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)


def _normalised(output: str) -> list[str]:
    """Lines without trailing blanks, times in milliseconds replaced (they vary per run)."""
    return [re.sub(r"\d+(\.\d+)? ms\b", "N ms", line).rstrip()
            for line in output.strip("\n").split("\n")]


def test_every_fenced_block_names_its_language():
    assert [b.where for b in BLOCKS if not b.language] == []


def test_every_command_block_is_run_here_run_by_a_named_test_or_marked_not_run_here():
    assert unmarked(BLOCKS) == [], (
        "mark each command block with <!-- run here -->, <!-- run by: tests/...py::test -->, "
        "or <!-- not run here: why -->")


def test_the_checks_catch_an_unmarked_block_a_missing_test_and_a_renamed_flag():
    page = ("<!-- run here -->\n```bash\nkv-offload inspect\n```\n\n"
            "```python\nprint(1)\n```\n\n"
            "<!-- run by: tests/unit/tools/test_cli.py::test_that_does_not_exist -->\n"
            "```bash\nkv-offload inspect --no-such-flag\n```\n")
    blocks = read_blocks(page, "page.md")
    assert unmarked(blocks) == ["page.md:6"]
    assert missing_runners(blocks[2]) == ["tests/unit/tools/test_cli.py::test_that_does_not_exist"]
    assert "--no-such-flag" in parse_error(kv_offload_invocations(blocks[2].text)[0])


@pytest.fixture(scope="module")
def run_here_results(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every `run here` block's run, all started at once (each spends most of its time
    importing torch; together they take the time of the slowest, not the sum)."""
    with ThreadPoolExecutor(max_workers=len(RUN_HERE) or 1) as pool:
        runs = {b.where: pool.submit(run_block, b, tmp_path_factory.mktemp("block"))
                for b in RUN_HERE}
        return {where: run.result() for where, run in runs.items()}


@pytest.mark.parametrize("block", RUN_HERE, ids=[b.where for b in RUN_HERE])
def test_a_block_marked_run_here_exits_as_documented_and_prints_its_expected_output(
        block, run_here_results):
    proc = run_here_results[block.where]
    assert proc.returncode == parse_mark(block.mark).exit_status, proc.stdout[-3000:]
    expected = expected_output(BLOCKS, block)
    if expected is not None:
        assert _normalised(proc.stdout) == _normalised(expected.text)


@pytest.mark.parametrize("block", RUN_BY, ids=[b.where for b in RUN_BY])
def test_a_block_run_by_a_test_names_files_and_tests_that_exist(block):
    assert missing_runners(block) == []


def test_a_block_run_by_ci_is_the_command_ci_runs_verbatim():
    ci_script = (REPO / ".ci/run").read_text().split("\n")
    by_ci = [b for b in RUN_BY if ".ci/run" in parse_mark(b.mark).runners]
    assert by_ci, "the README's test command is marked <!-- run by: .ci/run -->"
    for block in by_ci:
        assert all(line in ci_script for line in block.text.split("\n")), block.where


def test_the_readme_carries_the_test_command_ci_runs():
    readme = [b for b in RUN_BY if b.page == "README.md"
              and ".ci/run" in parse_mark(b.mark).runners]
    assert any("python -m pytest tests" in b.text for b in readme)


@pytest.mark.parametrize("block", SHELL, ids=[b.where for b in SHELL])
def test_every_kv_offload_command_parses_with_the_real_command_line(block):
    errors = {" ".join(args): parse_error(args) for args in kv_offload_invocations(block.text)}
    assert {args: error for args, error in errors.items() if error} == {}


@pytest.mark.parametrize("block", JSON_BLOCKS, ids=[b.where for b in JSON_BLOCKS])
def test_every_json_block_parses_and_a_connector_config_passes_parse_config(block, tmp_path):
    document = json.loads(block.text)
    if parse_mark(block.mark).kind == "not run here" or not isinstance(document, dict):
        return
    if "secret_file" in document:  # (the reader's own file: a fresh one stands in for it)
        document["secret_file"] = new_secret_file(tmp_path)
    if {"cpu_bytes_to_use", "storage_tier"} & set(document):
        # (with the start-up check of its policy and tier options: they connect nowhere)
        check_config(parse_config({"cpu_bytes_to_use": "1GiB", **document}))


def _table_rows(page: str, heading: str) -> list[list[str]]:
    """The cells of each body row of the first table under `heading` on `page`."""
    text = (REPO / "docs" / page).read_text()
    section = text[text.index(heading):]
    table = re.search(r"\n(\|.*\|\n)+", section).group(0)
    return [row.split("|") for row in table.strip().split("\n")[2:]]


def _documented_keys(page: str, heading: str) -> set[str]:
    """The first-column `names` of the table under `heading` on `page`."""
    return {name for cells in _table_rows(page, heading)
            for name in re.findall(r"`([a-z_]+)`", cells[1])}


def test_the_serving_page_documents_every_connector_configuration_key():
    declared = {f.name for f in dataclasses.fields(OffloadConfig)}
    documented = _documented_keys("serving.md", "## Configuration keys")
    top_level = {"kv_connector", "kv_connector_module_path", "kv_role", "kv_load_failure_policy"}
    assert documented - top_level == declared


@pytest.mark.parametrize("config, heading", [
    (FilesystemTierConfig, "### Filesystem options"),
    (ValkeyTierConfig, "### Valkey/Redis options"),
    (S3TierConfig, "### S3 options"),
])
def test_the_tiers_page_documents_every_storage_option_of_each_tier(config, heading):
    declared = {f.name for f in dataclasses.fields(config) if "kind" in f.metadata}
    assert _documented_keys("tiers.md", heading) == declared


def _documented_literal(value) -> str:
    """How the tiers page writes a default: JSON's booleans, quoted strings, Python numbers."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


@pytest.mark.parametrize("config, heading", [
    (FilesystemTierConfig, "### Filesystem options"),
    (ValkeyTierConfig, "### Valkey/Redis options"),
    (S3TierConfig, "### S3 options"),
])
def test_the_tiers_page_gives_each_storage_option_its_real_default(config, heading):
    # (the page once said 0 while the code said 10: only the names were checked then)
    fields = {f.name: f for f in dataclasses.fields(config) if "kind" in f.metadata}
    checked = 0
    for cells in _table_rows("tiers.md", heading):
        names = re.findall(r"`([a-z_]+)`", cells[1])
        shown = re.findall(r"`([^`]+)`", cells[2])  # ("`5.0` / `2.0`": one per name)
        for i, name in enumerate(names):
            default = fields[name].default
            if default is dataclasses.MISSING:
                assert cells[2].strip() == "required", (name, cells[2])
            elif default is None:  # (the page says what unset means: "AWS", "none", ...)
                continue
            elif fields[name].metadata["kind"] == "size":
                assert parse_size(name, shown[i]) == default, (name, cells[2], default)
            else:
                assert shown[i] == _documented_literal(default), (name, cells[2], default)
            checked += 1
    assert checked >= 6


MAX_PAGE_LINES = 600
_SESSION_WORDING = re.compile(  # a session of work named relative to another ("this stop")
    r"\b(this|last|next|previous|later|first|second|third|fourth)\s+stop\b|\bstop\s+before\b",
    re.IGNORECASE)


def test_no_documentation_page_is_longer_than_600_lines():
    # (docs/benchmarks.md grew to 2,416 lines of run-by-run notes: history goes to
    # docs/benchmarks-log/, split by area so that each page stays readable)
    long_pages = {}
    for path in sorted((REPO / "docs").rglob("*.md")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_PAGE_LINES:
            long_pages[str(path.relative_to(REPO))] = lines
    assert long_pages == {}


def session_wording(text: str, page: str) -> list[str]:
    """Where `text` names a session of work instead of a date, as 'page:line'."""
    return [f"{page}:{text.count(chr(10), 0, match.start()) + 1}"
            for match in _SESSION_WORDING.finditer(text)]


def test_pages_date_their_figures_instead_of_naming_work_sessions():
    # "this stop" / "last stop" meant nothing to a reader once the next session began:
    # figures say their date (and the log its commit) instead
    assert session_wording("ok\nas the last\nstop measured", "p.md") == ["p.md:2"]
    assert session_wording("vLLM stops the engine; run(start, stop)", "p.md") == []
    found = [where for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
             for where in session_wording(path.read_text(), str(path.relative_to(REPO)))]
    assert found == []
