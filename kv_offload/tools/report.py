"""What every `kv-offload` subcommand shows and writes: one table printer, one JSON envelope,
one progress line.

Contents:
- `Table`: rows of cells printed as aligned columns under a title and above notes.
- `envelope(command, results, statistic)`: the JSON every subcommand writes,
  ``{"command", "version", "statistic", "results"}``.
- `emit(table, envelope, json_path)`: print the table and write the envelope. ``--json -``
  writes the envelope to stdout and moves the table to stderr, so stdout parses as JSON.
- `Progress`: a one-line progress bar on stderr for long runs (bench sweeps, the demo).
- `positive_int`: the argparse type of every count flag (0 or less: exit status 2).
- `output_path`: the argparse type of every ``--json``/``--plot`` flag: a file whose folder
  exists and is writable, checked before anything runs (a long run must not end in a crash).
- `SubcommandParser`: a subcommand's parser that refuses flags it does not know itself, so
  the error shows that subcommand's usage, not the top-level one.

Why one module: a user reads several subcommands' output side by side (and scripts parse
their JSON); one printer and one envelope keep them alike. Why hand-written rather than `rich` or
`tqdm`: neither is a dependency of the base install (torch, numpy, safetensors, xxhash; only
vLLM brings them), `inspect` and `bench` run without vLLM, and the table and bar are a few
dozen lines whose plain-text output (one line per step when stderr is not a terminal) logs
and tests read as they are. The exit status rule lives with
each command (non-zero on any mismatch or failed key) but is computed from the same
`results` a script would read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kv_offload

# Every benchmark keeps the best of its repeats (the least disturbed run on a shared machine);
# every sample stays in the JSON ("samples"), so a reader can take another statistic.
STATISTIC = "best"


def version() -> str:
    """The version of the kv_offload package that runs (`kv_offload.__version__`, the one
    place it is written; an installed distribution's metadata is read from it)."""
    return kv_offload.__version__


def envelope(command: str, results: Any, statistic: str | None = None) -> dict[str, Any]:
    """The JSON document of one subcommand run. ``statistic`` says how repeated measurements
    were reduced (`STATISTIC` for benchmarks; None where nothing is repeated)."""
    return {"command": command, "version": version(), "statistic": statistic,
            "results": results}


@dataclass
class Table:
    """A titled table: columns aligned to their widest cell, numbers right-aligned."""

    title: str
    header: Sequence[str]
    rows: list[Sequence[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.header):
            raise ValueError(f"row {cells!r} has {len(cells)} cells, the header "
                             f"{list(self.header)} has {len(self.header)}")
        self.rows.append(cells)

    def render(self) -> str:
        text = [[_cell(c) for c in row] for row in [self.header, *self.rows]]
        widths = [max(len(row[i]) for row in text) for i in range(len(self.header))]
        numeric = [all(_is_number(row[i]) for row in self.rows) and bool(self.rows)
                   for i in range(len(self.header))]

        def line(row: Sequence[str]) -> str:
            return "  ".join(c.rjust(w) if num else c.ljust(w)
                             for c, w, num in zip(row, widths, numeric)).rstrip()

        lines = [self.title, line(text[0]), line(["-" * w for w in widths])]
        lines += [line(row) for row in text[1:]]
        return "\n".join(lines + self.notes)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _is_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def emit(tables: Sequence[Table], document: dict[str, Any], json_path: str | Path | None
         ) -> None:
    """Print the tables; write the envelope to ``json_path`` ("-": stdout, tables to stderr)."""
    to_stdout = str(json_path) == "-"
    stream = sys.stderr if to_stdout else sys.stdout
    for table in tables:
        print(table.render(), file=stream, end="\n\n")
    if json_path is None:
        return
    text = json.dumps(document, indent=2)
    if to_stdout:
        print(text, flush=True)
    else:
        Path(json_path).write_text(text + "\n")


class Progress:
    """``[#####.....] label: step 3/10`` rewritten in place on stderr (a new line per call when
    stderr is not a terminal, so logs stay readable)."""

    WIDTH = 20

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = max(1, total), label, 0
        self.stream = sys.stderr
        self._tty = self.stream.isatty()

    def step(self, what: str) -> None:
        """Announce the step about to run (the bar shows the steps finished before it)."""
        filled = self.WIDTH * self.done // self.total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        text = f"[{bar}] {self.label}: {what} ({self.done + 1}/{self.total})"
        print(("\r" + text) if self._tty else text, end="" if self._tty else "\n",
              file=self.stream, flush=True)
        self.done += 1

    def finish(self) -> None:
        if self._tty:
            print(file=self.stream, flush=True)


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (argparse turns the error into exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def output_path(text: str) -> str:
    """An argparse type: ``-`` (stdout) or a file path whose folder exists and is writable.

    Checked when the arguments are parsed, so a mistyped path is exit status 2 at once rather
    than a crash after the whole run."""
    if text == "-":
        return text
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file path")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {str(folder)!r} is not writable")
    return text


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: a flag it does not know is its own error (its usage, exit 2).

    argparse hands a subparser's unknown arguments back to the top-level parser, whose error
    then shows the top-level usage, which does not list the subcommand's flags."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras
