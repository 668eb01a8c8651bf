"""``conveyor up --reload``: a real ``up`` (its own redis-server, gateway, workers) in an
app folder whose module is edited under it: the answer changes once the edit is served, a
stage added gets its route, and a module that does not compile leaves the old processes
serving, with one line naming the file."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from conveyor.embedded import free_port
from conveyor.placement import Group
from conveyor.reload import AppInfo, scan
from tests.conveyor.test_cli import CONVEYOR
from tests.helpers import up_env, wait_for_line

pytestmark = pytest.mark.timeout(300)

MODULE = """
from pydantic import BaseModel

from pipelines.stages import Stage


class Text(BaseModel):
    text: str


class Greeter:
    def predict(self, items):
        return [{{"said": "{word} " + item["text"]}} for item in items]


greet = Stage("greet", Text, runner="myapp:Greeter", batch_wait_ms=1)
app = [greet{more}]
"""

SHOUT = """

class Shouter:
    def predict(self, items):
        return [{"said": item["text"].upper()} for item in items]


shout = Stage("shout", Text, runner="myapp:Shouter", batch_wait_ms=1)
"""


RAISES = (
    "class Greeter:\n",
    "class Greeter:\n    def __init__(self):\n        raise RuntimeError('no weights')\n\n",
)
"""What makes ``Greeter``'s constructor raise."""


def write(folder: Path, word: str, *, shout: bool = False) -> None:
    """The app module: ``greet`` says ``word``; with ``shout``, a second stage."""
    text = MODULE.format(word=word, more=", shout" if shout else "")
    path = folder / "myapp.py"
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text.replace("app = [", SHOUT + "\napp = [") if shout else text)
    # A file system with a coarse clock could keep the time: the change must show.
    os.utime(path, ns=(before + 10**9, before + 10**9))


def until(what: Callable[[], object], limit_s: float, why: Callable[[], str]) -> object:
    """Poll ``what`` until it returns something true; fail with ``why()`` after ``limit_s``."""
    give_up = time.monotonic() + limit_s
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < give_up, why()
        time.sleep(0.2)  # the reload restarts processes; nothing to await from here


def said(base: str, route: str) -> str | None:
    """``route``'s answer to ``hi``; None while it does not answer 200."""
    try:
        resp = httpx.post(f"{base}/v1/{route}", json={"text": "hi"}, timeout=20)
    except httpx.TransportError:  # the gateway restarting
        return None
    if resp.status_code != 200:
        return None
    value: str = resp.json()["said"]
    return value


def answered(base: str) -> str:
    """``greet``'s answer to ``hi``, which must come (200)."""
    resp = httpx.post(f"{base}/v1/greet", json={"text": "hi"}, timeout=60)
    assert resp.status_code == 200, resp.text
    value: str = resp.json()["said"]
    return value


def calls_across(
    base: str, change: Callable[[], None], done: Callable[[], bool]
) -> tuple[int, int]:
    """Calls to ``greet`` one after another, from ``change()`` until ``done()`` (or two
    minutes): (refused or reset, answered 200)."""
    refused = ok = 0
    change()
    give_up = time.monotonic() + 120
    while time.monotonic() < give_up and not done():
        try:
            resp = httpx.post(f"{base}/v1/greet", json={"text": "hi"}, timeout=30)
            ok += resp.status_code == 200
        except httpx.TransportError:
            refused += 1
    return refused, ok


def test_up_reload_serves_edits_new_stages_and_keeps_going_on_a_broken_module(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "proj"
    folder.mkdir()
    write(folder, "hello")
    port = free_port()
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [CONVEYOR, "up", "--reload", "--app", "myapp:app", "--port", str(port)],
            cwd=folder,
            env=up_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_line(log, "conveyor: ready:", proc, limit_s=120)
        assert "reload: watching the 1 .py file(s)" in log.read_text()
        assert said(base, "greet") == "hello hi"

        # Before: nothing watched the module; the old answer stayed until a restart by hand.
        # Every request sent across the restart is answered (the old worker finishes its
        # batch; what comes meanwhile waits in Redis for the new one).
        write(folder, "howdy")
        seen: list[str] = []

        def edited() -> bool:
            seen.append(answered(base))
            return seen[-1] == "howdy hi"

        until(edited, 120, log.read_text)
        assert set(seen) <= {"hello hi", "howdy hi"}, seen

        # A stage added: a new route (a new gateway), the old one still served. Before,
        # the old gateway stopped first and the port refused connections for seconds
        # (3,849 refused in 7.7 s under load); now the new one starts beside it and the
        # old one drains once the new one listens.
        refused, ok = calls_across(
            base,
            lambda: write(folder, "howdy", shout=True),
            lambda: "gateway stopped" in log.read_text() and said(base, "shout") == "HI",
        )
        until(lambda: said(base, "shout") == "HI", 120, log.read_text)
        assert said(base, "greet") == "howdy hi"
        assert "serves until it listens" in log.read_text()
        assert refused == 0, (refused, ok, log.read_text())
        assert ok > 0

        # A module that does not compile: one line naming it; the old processes serve.
        (folder / "myapp.py").write_text((folder / "myapp.py").read_text() + "\ndef broken(:\n")
        line = until(
            lambda: next(
                (x for x in log.read_text().splitlines() if "reload: myapp.py:" in x), None
            ),
            60,
            log.read_text,
        )
        assert "go on until it is fixed" in str(line), line
        assert said(base, "greet") == "howdy hi"
        assert said(base, "shout") == "HI"
        assert proc.poll() is None, log.read_text()

        # A model that cannot be built (its worker exits on a configuration error): up goes
        # on, and the next change starts it again.
        write(folder, "again", shout=True)
        path = folder / "myapp.py"
        path.write_text(path.read_text().replace(RAISES[0], RAISES[1]))
        until(lambda: "started again at the next change" in log.read_text(), 60, log.read_text)
        write(folder, "again", shout=True)
        until(lambda: said(base, "greet") == "again hi", 120, log.read_text)
        assert proc.poll() is None, log.read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, log.read_text()


def test_scan_watches_the_apps_modules_not_its_data_or_virtualenvs(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text("x = 1\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "helper.py").write_text("y = 2\n")
    for skipped in (".conveyor", "__pycache__", "venv"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "mod.py").write_text("z = 3\n")
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    assert sorted(scan(tmp_path)) == ["app.py", str(Path("pkg") / "helper.py")]


def test_only_the_workers_running_the_changed_code_restart() -> None:
    a, b = Group(("a",)), Group(("b",))
    info = AppInfo("s", (a, b), {"a": "a_model.py", "b": "app.py"}, "app.py")
    assert info.changed({"a_model.py"}, a)
    assert not info.changed({"a_model.py"}, b)
    # The app's module (the graph, the pipelines) and a helper no stage names: all of them.
    assert info.changed({"app.py"}, a)
    assert info.changed({"app.py"}, b)
    assert info.changed({"util.py"}, a)
    assert info.changed({"util.py"}, b)
    assert AppInfo.from_json(info.to_json()) == info
