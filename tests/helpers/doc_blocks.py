"""The fenced blocks of our Markdown pages, and the mark each command block carries.

A page is README.md or docs/**/*.md. A fenced block opens with three backticks and a
language (``bash``, ``python``, ``json``, ``text``, ``mermaid``...) and closes with three
backticks. A *command block* (``bash``, ``sh``, ``shell``, ``console``, ``python``) must say,
in an HTML comment on the line before it, how it stays true:

- ``<!-- run here -->`` (or ``<!-- run here: exit N -->``): tests/unit/project/test_doc_commands.py
  runs it and expects exit status 0 (N). If the next fenced block is marked
  ``<!-- expected output ... -->``, what it prints must match that block.
- ``<!-- run by: PATH[::TEST], ... -->``: a test file (and test in it) or a CI script runs
  the same thing.
- ``<!-- not run here: WHY -->``: it needs what this machine lacks (a GPU, a model, a
  server, minutes).

This module only reads pages; the checks live in the test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMAND_LANGUAGES = frozenset({"bash", "sh", "shell", "console", "python"})
_MARK = re.compile(r"^<!--\s*(.*?)\s*-->$")
_FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: str  # path relative to the repository
    line: int  # 1-based line of the opening fence
    language: str  # "" when the fence names none
    text: str  # the lines between the fences
    mark: str  # the HTML comment on the line before the fence ("" when none)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def is_command(self) -> bool:
        return self.language in COMMAND_LANGUAGES


@dataclass(frozen=True)
class RunMark:
    """What a block's mark says about running it."""

    kind: str  # "run here", "run by", "not run here" or "" (no valid mark)
    exit_status: int = 0  # run here: the status the block must exit with
    runners: tuple[str, ...] = ()  # run by: "path" or "path::test_name"
    reason: str = ""  # not run here: why


def pages(repo: Path = REPO) -> list[Path]:
    """README.md and every Markdown page of the documentation site."""
    return [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]


def read_blocks(text: str, page: str) -> list[Block]:
    """The fenced blocks of one page, in order; an unclosed fence is an error."""
    blocks: list[Block] = []
    lines = text.split("\n")
    opened: tuple[int, str] | None = None
    body: list[str] = []
    for index, line in enumerate(lines):
        fence = _FENCE.match(line)
        if opened is None:
            if fence:
                opened, body = (index, fence.group(1)), []
        elif line.strip() == "```":
            start, language = opened
            blocks.append(Block(page, start + 1, language, "\n".join(body),
                                _mark_before(lines, start)))
            opened = None
        else:
            body.append(line)
    if opened is not None:
        raise ValueError(f"{page}:{opened[0] + 1}: a fenced block is never closed")
    return blocks


def _mark_before(lines: list[str], index: int) -> str:
    """The HTML comment right above line `index` (blank lines between are allowed)."""
    for line in reversed(lines[:index]):
        if line.strip():
            match = _MARK.match(line.strip())
            return match.group(1) if match else ""
    return ""


def parse_mark(mark: str) -> RunMark:
    """`mark` as a RunMark; kind "" when it is none of the three marks."""
    if mark == "run here":
        return RunMark("run here")
    if match := re.fullmatch(r"run here: exit (\d+)", mark):
        return RunMark("run here", exit_status=int(match.group(1)))
    if mark.startswith("run by:"):
        runners = tuple(r.strip() for r in mark[len("run by:"):].split(",") if r.strip())
        return RunMark("run by", runners=runners) if runners else RunMark("")
    if mark.startswith("not run here:") and mark[len("not run here:"):].strip():
        return RunMark("not run here", reason=mark[len("not run here:"):].strip())
    return RunMark("")


def all_blocks(repo: Path = REPO) -> list[Block]:
    return [block for path in pages(repo)
            for block in read_blocks(path.read_text(), str(path.relative_to(repo)))]


def expected_output(blocks: list[Block], block: Block) -> Block | None:
    """The block marked `<!-- expected output ... -->` right after `block`, if any."""
    following = blocks[blocks.index(block) + 1:]
    if following and following[0].page == block.page \
            and following[0].mark.startswith("expected output"):
        return following[0]
    return None


def logical_lines(script: str) -> list[str]:
    """A shell script's lines with backslash continuations joined."""
    return script.replace("\\\n", " ").split("\n")
