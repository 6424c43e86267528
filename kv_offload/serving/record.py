"""The file `kv-offload serve-check --record` writes and `--replay` reads.

A JSON document: the prompts (token ids), the outputs of the cold pass (recompute) and of the
pass served by vLLM's own prefix cache (the reference), and how they were asked for
(max_tokens, logprobs), with the model they came from. A replay against another server
process — e.g. one restarted over the same disk directory — sends the same prompts and must
get the reference back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kv_offload.errors import ServeCheckInputError
from kv_offload.serving.client import Completion

if TYPE_CHECKING:  # check.py imports this module
    from kv_offload.serving.check import CheckReport

RECORD_FORMAT = "kv-offload-serve-check-record"
RECORD_VERSION = 1


def write_record(path: Path, report: CheckReport, max_tokens: int, logprobs: int) -> None:
    """Write the prompts and both reference passes of a `CheckReport` to `path`."""
    path.write_text(json.dumps({
        "format": RECORD_FORMAT, "version": RECORD_VERSION, "model": report.model,
        "block_size": report.block_size, "max_tokens": max_tokens,
        "logprobs": logprobs, "prompts": report.prompts,
        "recompute": [c.to_json() for c in report.recompute],
        "reference": [c.to_json() for c in report.reference],
    }))


@dataclass(frozen=True)
class Record:
    """What `record` wrote: the prompts, both passes' outputs and how they were asked."""

    prompts: list[list[int]]
    recompute: list[Completion]
    reference: list[Completion]
    max_tokens: int
    logprobs: int


def load_record(path: Path, model: str | None) -> Record:
    """Read a `--record` file; ServeCheckInputError names what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ServeCheckInputError(f"--replay {path}: cannot read a JSON record ({e})") from e
    if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
        raise ServeCheckInputError(f"--replay {path}: not a serve-check record (expected "
                                   f"format {RECORD_FORMAT!r}, written by --record)")
    if data.get("version") != RECORD_VERSION:
        raise ServeCheckInputError(f"--replay {path}: record version {data.get('version')!r}, "
                                   f"this kv-offload reads version {RECORD_VERSION}")
    if data.get("model") != model:
        raise ServeCheckInputError(f"--replay {path}: recorded against model "
                                   f"{data.get('model')!r}, the server serves {model!r}")
    try:
        record = Record(
            prompts=[list(p) for p in data["prompts"]],
            recompute=[Completion.from_json(o) for o in data["recompute"]],
            reference=[Completion.from_json(o) for o in data["reference"]],
            max_tokens=int(data["max_tokens"]),
            logprobs=int(data["logprobs"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ServeCheckInputError(f"--replay {path}: bad or missing field {e}") from e
    if not len(record.prompts) == len(record.recompute) == len(record.reference):
        raise ServeCheckInputError(
            f"--replay {path}: {len(record.prompts)} prompts but {len(record.recompute)} "
            f"recompute and {len(record.reference)} reference outputs")
    return record
