"""Every fenced block of the docs (README.md and docs/**/*.md) is run, or says why not.

How a page is run: each page gets an empty folder of its own, and its blocks are taken in
order. What the HTML comment on the line before a block says decides what happens to it:

- ``<!-- norun: why -->``: not run here (docker, kubectl, a command that serves until
  stopped); the reason is required.
- ``<!-- file: NAME -->``: the block's text is appended to ``NAME`` in the page's folder
  (a user's module, as the page tells them to write it).
- ``<!-- stack: conveyor up ARGS -->``: before this block, ``conveyor up ARGS`` is started
  in the page's folder on a free port (once: stacks with the same arguments are shared by
  pages, except an ``--app`` one, which belongs to its page), and this and the page's later
  blocks run against it: ``localhost:8000`` / ``127.0.0.1:8000`` in their text become that
  port, and ``CONVEYOR_REDIS_URL`` is set to the stack's Redis, the address ``up`` prints
  (as a reader pastes it into a second terminal).
- ``<!-- background: TEXT -->``: the block is a command that serves until stopped, as run
  in a second terminal: it is started in the page's folder, the page goes on once its
  output holds ``TEXT``, and it is stopped with SIGINT (and must exit 0) when the page's
  blocks are done.

Then, by language: ``python`` runs as a script (``python -c``) in the page's folder;
``bash`` runs as one ``bash -euo pipefail`` script there, ``curl`` failing on an HTTP error;
``console`` runs its ``$ `` lines the same way (the rest is their output, not compared);
``text``, ``yaml`` and ``json`` are output or file contents, not commands. A fence with no
language, or another language, fails: a new kind of block needs a rule here first. A
command block that needs the port and has no stack fails too; so does a ``background``
block that is not a command.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conveyor.embedded import free_port
from tests.conveyor.test_cli import CONVEYOR
from tests.helpers import REPO, up_env, wait_for_line

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(norun|file|stack|background):\s*(.*?)\s*-->\s*\Z", re.S)
COMMANDS = {"bash", "console"}
NOT_RUN = {"text", "yaml", "json"}
PORT = re.compile(r"(?:localhost|127\.0\.0\.1):8000\b")
REDIS_URL = re.compile(r"`CONVEYOR_REDIS_URL=(redis://\S+) ")
"""Where ``conveyor up`` prints its embedded Redis (conveyor/embedded.py)."""


@dataclass
class Block:
    """One fenced block of a page, with the marker before it."""

    page: Path
    line: int
    lang: str
    text: str
    marker: str | None = None
    arg: str = ""

    @property
    def where(self) -> str:
        page = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page
        return f"{page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in order, each with the marker on the line before."""
    text = page.read_text(encoding="utf-8")
    found = []
    for fence in FENCE.finditer(text):
        before = text[: fence.start()].rstrip("\n")
        last = before.rsplit("\n", 1)[-1]
        marker = MARKER.search(last)
        found.append(
            Block(
                page,
                text.count("\n", 0, fence.start()) + 1,
                fence[1].strip(),
                fence[2],
                marker[1] if marker else None,
                marker[2] if marker else "",
            )
        )
    return found


class Stacks:
    """The ``conveyor up`` stacks the pages asked for, kept for the module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.running: dict[tuple[str, str], tuple[subprocess.Popen[bytes], int, Path]] = {}
        self.redis: dict[tuple[str, str], str] = {}

    def start(self, command: str, folder: Path) -> tuple[int, str]:
        """The port and Redis URL of a running ``command`` (``conveyor up ...``), started
        if need be."""
        argv = shlex.split(command)
        assert argv[:2] == ["conveyor", "up"], f"a stack is a `conveyor up`: {command!r}"
        key = (command, str(folder) if "--app" in argv else "")
        if key in self.running:
            return self.running[key][1], self.redis[key]
        port = free_port()
        log = self.root / f"up-{len(self.running)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [CONVEYOR, *argv[1:], "--port", str(port)],
                cwd=folder if key[1] else self.root,
                env=up_env(TMPDIR=str(self.root)),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.running[key] = (proc, port, log)
        said = wait_for_line(log, "conveyor: ready:", proc, limit_s=400)
        found = REDIS_URL.search(said)
        assert found, f"`{command}` printed no Redis address:\n{said}"
        self.redis[key] = found[1]
        return port, found[1]

    def stop(self) -> None:
        interrupt([(proc, log, f"`{cmd}`") for (cmd, _), (proc, _, log) in self.running.items()])


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stacks]:
    running = Stacks(tmp_path_factory.mktemp("stacks"))
    try:
        yield running
    finally:
        running.stop()


def command_script(block: Block) -> str:
    """The shell script a command block runs."""
    if block.lang == "console":
        lines = [line[2:] for line in block.text.splitlines() if line.startswith("$ ")]
        assert lines, f"{block.where}: a console block with no `$ ` command"
        return "\n".join(lines) + "\n"
    return block.text


def run_page(page: Path, folder: Path, stacks: Stacks) -> int:
    """Run every block of ``page`` in ``folder``; the number of blocks run."""
    env = up_env()
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # `conveyor`, `python`
    curl_home = folder / ".curl"
    curl_home.mkdir()
    # curl fails on an HTTP error status, as the docs' calls are meant to succeed.
    (curl_home / ".curlrc").write_text("fail-with-body\nmax-time = 120\nsilent\nshow-error\n")
    env["CURL_HOME"] = str(curl_home)
    port: int | None = None
    ran = 0
    background: list[tuple[subprocess.Popen[bytes], Path, Block]] = []
    try:
        for block in blocks(page):
            known = {"python", *COMMANDS, *NOT_RUN}
            assert block.lang in known, f"{block.where}: a fence needs one of {sorted(known)}"
            if block.marker == "norun":
                assert block.arg, f"{block.where}: `norun:` must say why"
                continue
            if block.marker == "file":
                with (folder / block.arg).open("a", encoding="utf-8") as out:
                    out.write(block.text + "\n\n")
                continue
            if block.marker == "stack":
                port, env["CONVEYOR_REDIS_URL"] = stacks.start(block.arg, folder)
            if block.lang in NOT_RUN:
                continue
            text = block.text
            if PORT.search(text):
                assert port is not None, f"{block.where}: calls a gateway; needs a stack marker"
                text = PORT.sub(f"127.0.0.1:{port}", text)
            if block.lang == "python":
                argv = [sys.executable, "-c", text]
            else:
                script = command_script(Block(block.page, block.line, block.lang, text))
                argv = ["bash", "-euo", "pipefail", "-c", script]
            if block.marker == "background":
                assert block.lang in COMMANDS, f"{block.where}: a background block is a command"
                assert block.arg, f"{block.where}: `background:` must say what output to await"
                log = folder.with_name(f"{folder.name}-background-{len(background)}.log")
                with log.open("wb") as out:
                    proc = subprocess.Popen(
                        argv, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT
                    )
                background.append((proc, log, block))
                wait_for_line(log, block.arg, proc, limit_s=300)
                ran += 1
                continue
            done = subprocess.run(
                argv, cwd=folder, env=env, capture_output=True, text=True, timeout=300, check=False
            )
            assert done.returncode == 0, (
                f"{block.where} failed:\n{text}\n{done.stdout}{done.stderr}"
            )
            ran += 1
    finally:
        interrupt([(proc, log, block.where) for proc, log, block in background])
    return ran


def interrupt(running: list[tuple[subprocess.Popen[bytes], Path, str]]) -> None:
    """Stop each named process as Ctrl-C stops it: each must exit 0 (its log says why
    not); one still running after 90 s is killed and fails the test."""
    for proc, _, _ in running:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    for proc, log, name in running:
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{name} did not stop:\n{log.read_text()}") from None
        assert code == 0, f"{name} exited {code}:\n{log.read_text()}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_block_of_the_page_runs_or_says_why_not(
    page: Path, stacks: Stacks, tmp_path: Path
) -> None:
    folder = tmp_path / "page"
    folder.mkdir()
    run_page(page, folder, stacks)


def test_the_block_rules_catch_what_they_promise(tmp_path: Path) -> None:
    # The parser itself: a broken one would make every page pass by running nothing.
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- norun: serves until stopped -->\n```bash\nmake up\n```\n\n"
        "<!-- file: m.py -->\n```python\nX = 2\n```\n\n"
        "```python\nimport m\nassert m.X == 2\n```\n\n"
        "```console\n$ python -c 'print(1)'\n1\n```\n\n"
        "<!-- background: serving -->\n```bash\ntrap 'exit 0' INT\ntouch up.flag\n"
        "echo serving\nwhile true; do sleep 0.1; done\n```\n\n"
        "```bash\ntest -f up.flag\n```\n"
    )
    found = blocks(page)
    assert [(b.lang, b.marker) for b in found] == [
        ("bash", "norun"),
        ("python", "file"),
        ("python", None),
        ("console", None),
        ("bash", "background"),
        ("bash", None),
    ]
    folder = tmp_path / "run"
    folder.mkdir()
    assert run_page(page, folder, Stacks(tmp_path)) == 4
    for bad in (
        "```\nls\n```\n",
        "<!-- norun: -->\n```bash\nls\n```\n",
        "```bash\nfalse\n```\n",
        "<!-- background: x -->\n```python\nprint('x')\n```\n",  # not a command
        "<!-- background: never -->\n```bash\ntrue\n```\n",  # exits before it says so
    ):
        page.write_text(bad)
        other = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        other.mkdir()
        with pytest.raises(AssertionError):
            run_page(page, other, Stacks(tmp_path))
