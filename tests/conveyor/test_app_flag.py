"""One way to name the user's app on every command (issue 29, item 1): ``--app`` (else
``CONVEYOR_APP``) on ``up``, ``worker``, ``gateway``, ``status``, ``dlq``, ``keda`` and
``graph``, the module imported from the current folder; a worker started by hand from
the app's folder joins its stage's group and takes work (docs/app.md's "scale out")."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from conveyor.embedded import free_port
from pipelines.keys import Keys
from pipelines.registry import load_registry
from pipelines.settings import CommonSettings
from tests.conveyor.test_cli import CONVEYOR
from tests.helpers import REPO, up_env, wait_for_line, wait_ready

DOC = REPO / "docs" / "app.md"


def doc_module() -> str:
    """docs/app.md's ``mymodule.py``: its first Python block, so the doc's example is
    the one tested."""
    found = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert found, DOC
    return found.group(1)


APP = "mymodule:wc"
"""The doc's app: a bare Stage."""

EXTRA = """
number = 3
stages_and_pipelines = [wc, 4]
"""
"""What --app must refuse, added to the doc's module."""


def cli(folder: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``conveyor ARGS`` run in ``folder`` (on no import path), this checkout's code."""
    full = up_env(**env)
    assert str(folder) not in full["PYTHONPATH"]
    return subprocess.run(
        [CONVEYOR, *args], cwd=folder, env=full, capture_output=True, text=True, timeout=90
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's folder, holding docs/app.md's ``mymodule.py``."""
    made = tmp_path_factory.mktemp("project")
    (made / "mymodule.py").write_text(doc_module() + EXTRA)
    return made


@dataclass
class Up:
    """``conveyor up --app`` running in the user's folder."""

    base: str
    redis_url: str
    log: Path


@pytest.fixture(scope="module")
def up(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """``conveyor up --app mymodule:wc`` run in ``folder``, as docs/app.md says."""
    port = free_port()
    log = tmp_path_factory.mktemp("up") / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [CONVEYOR, "up", "--port", str(port), "--app", APP],
            cwd=folder,
            env=up_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        text = wait_for_line(log, "conveyor: ready:", proc, limit_s=90)
        found = re.search(r"CONVEYOR_REDIS_URL=(redis://\S+)", text)
        assert found, text
        yield Up(f"http://127.0.0.1:{port}", found.group(1), log)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def answer(base: str, client: httpx.Client) -> dict[str, int]:
    """One request to the doc's stage, answered."""
    resp = client.post(f"{base}/v1/wc", json={"text": "one two"}, timeout=60)
    assert resp.status_code == 200, resp.text
    got: dict[str, int] = resp.json()
    assert got["words"] == 2, got
    return got


def test_a_worker_started_by_hand_in_the_apps_folder_takes_work(
    folder: Path, up: Up, tmp_path: Path
) -> None:
    # Before: `conveyor worker wc --app ...` was a usage error (no --app), and without it
    # "unknown stage 'wc'; known: <built-ins>": scaling out your own app did not work.
    with httpx.Client() as client:
        first = answer(up.base, client)["pid"]  # up's one worker: the only one yet
        log = tmp_path / "worker.log"
        with log.open("wb") as out:
            hand = subprocess.Popen(
                [CONVEYOR, "worker", "wc", "--app", APP],
                cwd=folder,
                env=up_env(CONVEYOR_REDIS_URL=up.redis_url),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            # Requests go to whichever worker is reading; once it has joined the group,
            # the hand-started one answers some of them.
            seen = {first}
            give_up = time.monotonic() + 120
            while hand.pid not in seen:
                assert hand.poll() is None, log.read_text()
                assert time.monotonic() < give_up, (seen, log.read_text())
                seen.add(answer(up.base, client)["pid"])
                time.sleep(0.05)  # polling: the worker is still loading
            assert first != hand.pid
        finally:
            hand.send_signal(signal.SIGINT)
            code = hand.wait(timeout=60)
    assert code == 0, log.read_text()
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_status_with_an_app_shows_its_stages_only(folder: Path, up: Up, how: str) -> None:
    # Before: `status --app` was a usage error, and with CONVEYOR_APP it listed every
    # stage that ever ran on that Redis beside the app's: here the built-in embed, as if
    # an earlier `conveyor up` without --app had served it.
    with redis.Redis.from_url(up.redis_url) as client:
        namespace = CommonSettings.model_fields["namespace"].default  # up_env sets none
        client.sadd(Keys(namespace).stages_set(), "embed")
    if how == "flag":
        done = cli(folder, "status", "--app", APP, CONVEYOR_REDIS_URL=up.redis_url)
    else:
        done = cli(folder, "status", CONVEYOR_REDIS_URL=up.redis_url, CONVEYOR_APP=APP)
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split()[0] == "stage", done.stdout
    assert [row.split()[0] for row in rows] == ["wc"], done.stdout


def test_a_gateway_started_with_app_serves_it(folder: Path, up: Up, tmp_path: Path) -> None:
    # Before: `conveyor gateway --app` was a usage error (exit 2).
    port = free_port()
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        gateway = subprocess.Popen(
            [CONVEYOR, "gateway", "--port", str(port), "--app", APP],
            cwd=folder,
            env=up_env(CONVEYOR_REDIS_URL=up.redis_url),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, {"gateway": gateway}, lambda _: log.read_text())
        with httpx.Client() as client:
            answer(base, client)  # routed by this gateway, answered by up's worker
    finally:
        gateway.send_signal(signal.SIGINT)
        gateway.wait(timeout=60)


def test_dlq_keda_and_graph_take_app(folder: Path, redis_url: str) -> None:
    # Before: none of these took --app (graph did, but not a Stage: "is a Stage, not
    # pipelines"); keda and dlq only read CONVEYOR_APP.
    namespace = f"t{uuid.uuid4().hex[:12]}"
    settings = {"CONVEYOR_REDIS_URL": redis_url, "CONVEYOR_NAMESPACE": namespace}
    dlq = cli(folder, "dlq", "list", "wc", "--app", APP, **settings)
    assert dlq.returncode == 0, dlq.stderr
    assert "0 dead letter(s)" in dlq.stdout, dlq.stdout
    keda = cli(folder, "keda", "wc", "--app", APP, **settings)
    assert keda.returncode == 0, keda.stderr
    assert "# wc, interactive lane" in keda.stdout, keda.stdout
    graph = cli(folder, "graph", "wc", "--app", APP)
    assert graph.returncode == 0, graph.stderr
    assert graph.stdout.startswith("pipeline wc (input: Text)"), graph.stdout


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (
            ["graph", "wc", "--app", "mymodule:number"],
            {},
            "conveyor: --app 'mymodule:number' is an int; it must be a Pipeline, a Stage, "
            "a list of them, or a function returning one",
        ),
        (
            ["graph", "wc", "--app", "mymodule:stages_and_pipelines"],
            {},
            "conveyor: --app 'mymodule:stages_and_pipelines' is a list holding an int; "
            "it must be a Pipeline, a Stage",
        ),
        (["worker", "wc", "--app", "mymodule"], {}, "conveyor: --app 'mymodule' must look like"),
        (["status"], {"CONVEYOR_APP": "mymodule"}, "conveyor: CONVEYOR_APP='mymodule' must look"),
        (
            ["worker", "wc"],
            {},
            "(the built-ins; a stage of your own app needs --app module:attribute or CONVEYOR_APP)",
        ),
    ],
)
def test_a_bad_app_is_one_line_naming_the_flag_or_variable(
    folder: Path, args: list[str], env: dict[str, str], says: str
) -> None:
    unreachable = f"redis://127.0.0.1:{free_port()}/0"  # nothing may get as far as Redis
    done = cli(folder, *args, CONVEYOR_REDIS_URL=unreachable, **env)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert says in line, line


def test_an_app_may_name_stages_among_its_pipelines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: "--app 'm:counter' is a Stage, not pipelines", and a list holding one, or a
    # function returning one, was refused too.
    module = f"app_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{module}.py").write_text(
        doc_module()
        + "\nfrom pipelines.graph import Pipeline, model\n"
        + "chain = Pipeline('chain', Text, (model('count', wc),))\n"
        + "both = [chain, wc]\n"
        + "def made():\n    return wc\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder it adds goes with the test
    try:
        alone = load_registry(f"{module}:wc", None)
        assert list(alone.pipelines) == ["wc"]
        assert alone.pipeline("wc").entry.stage.name == "wc"
        both = load_registry(f"{module}:both", None)
        assert sorted(both.pipelines) == ["chain", "wc"]
        assert list(both.stages) == ["wc"]  # one stage, one stream, shared
        assert list(load_registry(f"{module}:made", None).pipelines) == ["wc"]
    finally:
        sys.modules.pop(module, None)


@pytest.mark.parametrize("name", ["http.py", "queue.py", "json/__init__.py"])
def test_an_app_named_like_a_standard_module_is_the_shadowing_line(
    tmp_path: Path, name: str
) -> None:
    # Before: "--app 'http:wc': module 'http' has no 'wc'": Python's own http, imported
    # before the app, was found in its place; the user's file was never read.
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text(doc_module())
    module = name.removesuffix(".py").removesuffix("/__init__")
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    done = cli(tmp_path, "graph", "wc", "--app", f"{module}:wc", CONVEYOR_REDIS_URL=unreachable)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    shown = tmp_path.resolve() / name.removesuffix("/__init__.py")
    assert line.startswith(f"conveyor: {shown} is named like a module of Python's "), line
    assert f"({module!r})" in line, line
    assert line.endswith("rename it"), line
