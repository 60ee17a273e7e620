"""The examples of the documentation site's Getting-started and how-to pages, and how each is checked.

Every fenced block of a page under `docs/getting-started/` and `docs/how-to/` has a language, and
every shell or Python block is run by `tests/e2e/test_docs_examples.py` against a real server, in
order, in one working directory per page, unless it is marked otherwise. A mark is an HTML comment
on the line right before the block (invisible on the site):

- no mark: run (`bash -euo pipefail`, or `python`); it must succeed within `BLOCK_TIMEOUT_S`;
- `<!-- expect: TEXT -->`: run, and its output must contain TEXT;
- `<!-- server -->`: a command that starts `servewell serve`: run in the background until the page's
  server is ready, stopped (SIGTERM to its process group) after the page's last block;
- `<!-- file: PATH -->`: a file's content (any language), written to PATH in the page's working directory;
- `<!-- illustrative: REASON -->`: not run; REASON says why (it installs packages, needs a cluster,
  runs for minutes, ...).

The pages say 127.0.0.1:8000 (HTTP) and 8001 (gRPC), servewell's defaults; the test gives each
page free ports instead: it sets `SERVEWELL_PORT` and `SERVEWELL_GRPC_PORT` (a `servewell serve`
without `--port` listens there) and replaces the numbers 8000 and 8001 in the blocks it runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: The pages whose examples are run: a reader copies them as they are.
EXAMPLE_DIRS = ("getting-started", "how-to")
SHELL = ("sh", "bash", "shell")
PYTHON = ("python", "py")
#: Transcripts (a prompt and what it printed) cannot run; they must be marked illustrative.
TRANSCRIPTS = ("console",)
MARKS = ("expect", "server", "file", "illustrative")
BLOCK_TIMEOUT_S = 120.0

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
_MARK = re.compile(r"^\s*<!--\s*(?P<kind>[a-z-]+)\s*(?::\s*(?P<arg>.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page and its mark."""

    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    mark: str | None  # None, or one of MARKS (an unknown one is kept as written, for the test to name)
    arg: str

    @property
    def where(self) -> str:
        """`docs/how-to/x.md:12`, for messages."""
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runnable(self) -> bool:
        """Whether the test runs this block (as a command, a server or a file it writes)."""
        if self.mark == "file":
            return True
        if self.mark == "illustrative":
            return False
        return self.lang in SHELL + PYTHON + TRANSCRIPTS


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of `page` with their marks (a block inside a list item too)."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body: list[str] = []
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            line = lines[end]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())  # a list item's block
            end += 1
        previous = lines[index - 1] if index > 0 else ""
        mark = _MARK.match(previous)
        found.append(Block(page, index + 1, opening["lang"].lower(), "\n".join(body) + "\n",
                           mark["kind"] if mark else None, (mark["arg"] or "").strip() if mark else ""))
        index = end + 1
    return found


def example_pages() -> list[Path]:
    """The Getting-started and how-to pages, in the order a reader meets them."""
    return sorted(path for folder in EXAMPLE_DIRS for path in (DOCS / folder).glob("*.md"))


def mark_problems(block: Block) -> list[str]:
    """What is wrong with a block's language or mark (empty when nothing is)."""
    problems = []
    if not block.lang:
        problems.append("has no language: give one (sh, python, yaml, json, text, ...)")
    if block.mark is not None and block.mark not in MARKS:
        problems.append(f"has an unknown mark {block.mark!r} (marks: {', '.join(MARKS)})")
    if block.mark in ("illustrative", "file", "expect") and not block.arg:
        problems.append(f"mark {block.mark!r} needs its argument (a reason, a path or the text expected)")
    if block.mark in ("server", "expect") and block.lang not in SHELL + PYTHON:
        problems.append(f"mark {block.mark!r} is for a shell or Python block, not {block.lang!r}")
    if block.lang in TRANSCRIPTS and block.mark != "illustrative":
        problems.append("is a transcript: mark it illustrative with a reason, or make it a command that runs")
    if block.mark == "file" and (block.arg.startswith("/") or ".." in Path(block.arg).parts):
        problems.append(f"writes {block.arg!r}: a file must stay inside the page's working directory")
    return problems


def with_ports(text: str, http_port: int, grpc_port: int) -> str:
    """A block's text with servewell's default ports replaced by the page's own."""
    return re.sub(r"\b8001\b", str(grpc_port), re.sub(r"\b8000\b", str(http_port), text))
