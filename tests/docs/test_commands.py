"""Every ``conveyor`` command line the docs show is one the ``conveyor`` command accepts.

tests/docs/test_blocks.py runs each fenced block of the docs, or takes the block's
``norun:`` reason for not running it (a command that serves until stopped, docker). What
is not run is still checked here: each ``conveyor ...`` line of a ``norun`` block, and
each ``conveyor ...`` command written in a code span of the prose, is parsed by the real
``conveyor`` argument parser (its subcommands, options and their values), which stops
before it acts. A span that only names a command (``conveyor dlq replay``, its stage left
out) passes; an option or subcommand that does not exist (``conveyor up --profile hub``,
issue 39) or a value it refuses fails. Grammar (``list|replay``, ``[--id ID]``,
``<stage>``) is a synopsis, not a command line, and is left out.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.cli import main
from tests.docs.test_blocks import COMMANDS, PAGES, blocks
from tests.helpers import REPO

SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
SHELL_STOP = {"|", "||", "&&", ";", "&", ">", ">>", "<", "(", ")"}
SYNOPSIS = re.compile(r"\w\|\w|\[|<\w|\.\.\.")
"""What marks a synopsis after ``conveyor``: ``a|b``, ``[--id ID]``, ``<stage>``, ``STAGE...``."""
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
ONLY_NAMED = "the following arguments are required"


class Parsed(Exception):
    """The command line parsed; nothing was run."""


def argv_of(line: str) -> list[str] | None:
    """The argv after ``conveyor`` of a shell line that runs it (variables set before it
    dropped, the line cut at a pipe or a redirect), or None: not a ``conveyor`` line."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        words = list(lexer)
    except ValueError:
        return None
    while words and ASSIGNMENT.match(words[0]):
        words.pop(0)
    if not words or words[0] != "conveyor":
        return None
    argv = []
    for word in words[1:]:
        if word in SHELL_STOP:
            break
        argv.append(word)
    return argv


def command_lines(page: Path) -> Iterator[tuple[str, list[str]]]:
    """``(where, argv)`` of each ``conveyor`` command line the page shows that its block
    test does not run: in code spans of the prose, and in ``norun`` blocks."""
    text = page.read_text(encoding="utf-8")
    where = page.relative_to(REPO) if page.is_relative_to(REPO) else page.name
    fenced = [
        (m.start(), m.end()) for m in re.finditer(r"^```[^\n]*\n.*?^```[ \t]*$", text, re.S | re.M)
    ]
    for span in SPAN.finditer(text):
        if any(start <= span.start() < end for start, end in fenced):
            continue
        if _synopsis(span[1]):
            continue
        argv = argv_of(span[1])
        if argv and re.match(r"[A-Za-z-]", argv[0]):  # not output (`conveyor 0.1.0`)
            yield f"{where}:{text.count(chr(10), 0, span.start()) + 1}", argv
    for block in blocks(page):
        if block.marker != "norun" or block.lang not in COMMANDS:
            continue
        joined = block.text.replace("\\\n", " ")
        for number, line in enumerate(joined.splitlines()):
            line = line.removeprefix("$ ") if block.lang == "console" else line
            argv = argv_of(line)
            if argv is not None and not _synopsis(line.split("#")[0]):
                yield f"{block.where}+{number + 1}", argv


def _synopsis(line: str) -> bool:
    """Whether what follows ``conveyor`` on ``line`` is a synopsis, not a command line."""
    return bool(SYNOPSIS.search(line.partition("conveyor ")[2]))


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str | None:
    """Why the ``conveyor`` parser refuses ``argv`` (None: it accepts it, or the line
    only names a command and leaves its arguments out)."""
    capsys.readouterr()
    try:
        main(argv)
    except Parsed:
        return None
    except SystemExit as exc:
        said = capsys.readouterr().err.strip().splitlines()
        if exc.code in (0, None) or (said and ONLY_NAMED in said[-1]):
            return None
        return said[-1] if said else f"exit {exc.code}"
    return "ran past the parser"  # cannot happen: parse_args raises Parsed


@pytest.fixture
def parse_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``conveyor``'s parser parses, then stops before the command acts."""
    parse = argparse.ArgumentParser.parse_args

    def parsed(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        parse(self, *args, **kwargs)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parsed)


@pytest.mark.usefixtures("parse_only")
def test_every_conveyor_command_line_of_the_docs_parses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    found = [(where, argv) for page in PAGES for where, argv in command_lines(page)]
    assert len(found) > 40  # the scan sees the docs' commands
    refused = []
    for where, argv in found:
        why = refusal(argv, capsys)
        if why is not None:
            refused.append(f"{where}: conveyor {shlex.join(argv)}: {why}")
    assert not refused, "the docs show command lines conveyor refuses:\n" + "\n".join(refused)


@pytest.mark.usefixtures("parse_only")
def test_the_scan_catches_what_it_promises(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Run `conveyor up --profile hub`, or `conveyor dlq replay` (its stage), or\n"
        "`conveyor dlq list|replay STAGE`, or `CONVEYOR_X=1 conveyor status | head`.\n\n"
        "<!-- norun: serves -->\n```bash\nconveyor up --gateways 0  # a comment\n"
        "conveyor up \\\n  --pipelines echo\n```\n\n"
        "```bash\nconveyor up --no-such-flag\n```\n"  # run by test_blocks, not here
    )
    found = [argv for _, argv in command_lines(page)]
    assert found == [
        ["up", "--profile", "hub"],
        ["dlq", "replay"],
        ["status"],
        ["up", "--gateways", "0"],
        ["up", "--pipelines", "echo"],
    ]
    verdicts = [refusal(argv, capsys) for argv in found]
    assert verdicts[0] is not None
    assert "--profile" in verdicts[0]
    assert verdicts[1] is None  # names the command
    assert verdicts[2] is None
    assert verdicts[3] is not None
    assert "--gateways" in verdicts[3]
    assert verdicts[4] is None
