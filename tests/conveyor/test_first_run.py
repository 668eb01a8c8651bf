"""What a user meets first (issue 25, items 1, 2, 5 and 6): ``conveyor up --app`` run in
the folder of their module, a model class without ceremony, start-up output that says
where everything is and is true, errors of one line, and no password shown."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conveyor.embedded import free_port
from conveyor.readiness import gateway_url
from pipelines.settings import redact_url
from pipelines.stages import Stage
from tests.conveyor.test_cli import CONVEYOR
from tests.helpers import NumberIn, conveyor, up_env, wait_for_line
from workers.build import build_model
from workers.settings import WorkerSettings

APP = """
from pydantic import BaseModel

from pipelines.graph import Pipeline, model
from pipelines.stages import Stage


class Text(BaseModel):
    text: str


class WordCounter:
    def predict(self, items):
        return [{"words": len(item["text"].split())} for item in items]


class Needy:
    def __init__(self, threshold):
        self.threshold = threshold

    def predict(self, items):
        return items


class Broken:
    def __init__(self, model):
        raise ValueError(f"no weights at {model}")

    def predict(self, items):
        return items


def one(name, runner, **options):
    return Pipeline(name, Text, (model(name, Stage(name, Text, runner=runner, **options)),))


pipeline = one("wordcount", "mymodule:WordCounter")
needy = one("needy", Needy)
broken = one("broken", "mymodule:Broken", model="/weights/none")
"""
"""A user's module: a plain model class, and two whose constructors fail."""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The user's folder, holding ``mymodule.py`` (and on no import path)."""
    made = tmp_path / "project"
    made.mkdir()
    (made / "mymodule.py").write_text(APP)
    return made


def run(argv: list[str], folder: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``argv`` run in ``folder``, with this checkout's code (and not ``folder``) on
    PYTHONPATH."""
    full = up_env(**env)
    assert str(folder) not in full["PYTHONPATH"]
    return subprocess.run(argv, cwd=folder, env=full, capture_output=True, text=True, timeout=60)


def test_up_serves_a_module_of_the_current_folder_and_says_where_everything_is(
    folder: Path, tmp_path: Path
) -> None:
    # Items 1, 2, 5: `No module named 'mymodule'` without PYTHONPATH=.; a model class
    # without `model=, device=, dtype=, cache_dir=` was a TypeError; no /docs, /status or
    # /metrics URL; a `conveyor status` hint naming a URL up never printed; `ready:`
    # before the gateway bound; a /tmp/conveyor-redis-* left by every run.
    port = free_port()
    tmp = tmp_path / "tmp"  # where up's embedded Redis keeps its files: this test's own
    tmp.mkdir()
    log = tmp_path / "up.log"
    argv = [CONVEYOR, "up", "--port", str(port), "--app", "mymodule:pipeline"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=folder, env=up_env(TMPDIR=str(tmp)), stdout=out, stderr=subprocess.STDOUT
        )
    base = f"http://127.0.0.1:{port}"
    try:
        text = wait_for_line(log, "conveyor: ready:", proc, limit_s=50)
        # Ready means the gateway answers: the first request is served, no retry.
        answer = httpx.post(f"{base}/v1/wordcount", json={"text": "one two three"}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"words": 3}
        for path in ("/docs", "/status", "/metrics"):
            assert f"{base}{path}" in text, text
        assert not list(tmp.glob("conveyor-redis-*")), text  # it keeps nothing there
        # What up prints for `conveyor status` is true, and status (like every command)
        # imports the app from the current folder too.
        found = re.search(r"CONVEYOR_REDIS_URL=(redis://\S+) conveyor status", text)
        assert found, text
        status = run(
            [CONVEYOR, "status"],
            folder,
            CONVEYOR_REDIS_URL=found.group(1),
            CONVEYOR_APP="mymodule:pipeline",
        )
        assert status.returncode == 0, status.stderr
        row = next(line for line in status.stdout.splitlines() if line.startswith("wordcount "))
        assert row.split()[4] == "1/1", status.stdout  # its consumer, alive: up's worker
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=45)
    text = log.read_text()
    assert code == 0, text
    assert "Traceback" not in text, text
    assert not list(tmp.glob("conveyor-redis-*")), text


@pytest.mark.parametrize(
    ("app", "module", "says"),
    [
        ("nosuch:pipeline", None, "no module 'nosuch' in {folder} nor on the import path; "),
        ("mymodule:pipelin", APP, "module 'mymodule' has no 'pipelin'; it has broken, needy"),
        ("mymodule:app", "import notinstalled_xyz\n", "importing mymodule failed: "),
        ("mymodule:app", "\nraise RuntimeError('boom')\n", "RuntimeError: boom (at {folder}"),
        ("mymodule:app", "def broken(:\n", "importing mymodule raised SyntaxError: "),
    ],
)
def test_an_app_that_cannot_be_imported_is_one_line_with_a_hint(
    folder: Path, app: str, module: str | None, says: str
) -> None:
    # Item 1: `No module named 'mymodule'` with no hint; a traceback for anything else.
    if module is None:
        (folder / "mymodule.py").unlink()
    else:
        (folder / "mymodule.py").write_text(module)
    done = run([CONVEYOR, "up", "--port", str(free_port()), "--app", app], folder)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"conveyor: --app {app!r}: "), line
    assert says.format(folder=folder) in line, line
    assert "embedded redis" not in done.stdout  # nothing started


@pytest.mark.parametrize("argv", [["-m", "gateway"], ["-m", "workers", "wordcount"]])
def test_the_gateway_and_a_worker_import_the_app_from_the_current_folder(
    folder: Path, argv: list[str]
) -> None:
    # Item 1, `python -m gateway` / `python -m workers` with CONVEYOR_APP: a missing
    # module is one line with the hint; a present one is found without PYTHONPATH=.
    (folder / "other.py").write_text("pipeline = 1\n")  # found, but holds no pipeline
    for app, says in (
        ("nosuch:pipeline", "no module 'nosuch' in "),
        ("other:pipeline", "is an int; it must be a Pipeline, a Stage"),
    ):
        unreachable = f"redis://127.0.0.1:{free_port()}/0"
        done = run(
            [sys.executable, *argv], folder, CONVEYOR_APP=app, CONVEYOR_REDIS_URL=unreachable
        )
        assert done.returncode == 2, done.stderr[-2000:]
        assert "Traceback" not in done.stderr, done.stderr[-2000:]
        assert f"conveyor: --app {app!r}" in done.stderr, done.stderr[-2000:]
        assert says in done.stderr, done.stderr[-2000:]


class Plain:
    """A model with no constructor of its own."""

    def predict(self, items: list[dict[str, object]]) -> list[dict[str, object]]:
        """Nothing to do."""
        return items


class Some(Plain):
    """Takes two of the standard options, and one of its stage's."""

    def __init__(self, model: str, *, device: str, scale: int = 1) -> None:
        self.got = {"model": model, "device": device, "scale": scale}


class Every(Plain):
    """Takes whatever it is given."""

    def __init__(self, **options: object) -> None:
        self.got = options


def test_a_runner_is_given_only_the_options_its_constructor_takes(cache_dir: Path) -> None:
    # Item 2: every runner was called with model=, device=, dtype=, cache_dir=.
    settings = WorkerSettings(device="cpu", cache_dir=str(cache_dir))
    assert isinstance(build_model(Stage("plain", NumberIn, runner=Plain), settings), Plain)
    some = build_model(
        Stage("some", NumberIn, runner=Some, model="m", options={"scale": 3}), settings
    )
    assert isinstance(some, Some)
    assert some.got == {"model": "m", "device": "cpu", "scale": 3}
    every = build_model(Stage("every", NumberIn, runner=Every, model="m"), settings)
    assert isinstance(every, Every)
    assert every.got == {
        "model": "m",
        "device": "cpu",
        "dtype": "auto",
        "cache_dir": str(cache_dir),
    }


@pytest.mark.parametrize(
    ("stage", "env", "says"),
    [
        (
            "needy",
            {"CONVEYOR_APP": "mymodule:needy"},
            "conveyor: stage 'needy': cannot build mymodule:Needy (given no arguments): "
            "TypeError: Needy.__init__() missing 1 required positional argument: 'threshold'",
        ),
        (
            "broken",
            {"CONVEYOR_APP": "mymodule:broken"},
            "conveyor: stage 'broken': cannot load model '/weights/none' with mymodule:Broken: "
            "ValueError: no weights at /weights/none (at {folder}/mymodule.py:",
        ),
        (
            "embed",
            {"CONVEYOR_MODELS": '{"embed": "/weights/none"}', "CONVEYOR_PIPELINES": "embed"},
            "conveyor: stage 'embed': cannot load model '/weights/none' with "
            "workers.models.hf_embed:Embedder: OSError: ",
        ),
    ],
)
def test_a_constructor_that_fails_ends_the_worker_with_one_line(
    folder: Path, stage: str, env: dict[str, str], says: str
) -> None:
    # Items 2 and 5: a raw `TypeError: WordCounter() takes no arguments` traceback, and
    # a bad model path as a raw huggingface traceback. The model loads before the worker
    # looks for Redis: an unreachable one is never reached.
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    done = run(
        [sys.executable, "-m", "workers", stage], folder, CONVEYOR_REDIS_URL=unreachable, **env
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("conveyor:")]
    assert line.startswith(says.format(folder=folder)), line
    if stage == "embed":  # what to do about it
        assert line.endswith("; check its path or hub id (CONVEYOR_MODELS, or the stage's model=)")


def test_up_reports_a_worker_whose_model_cannot_be_built(folder: Path, tmp_path: Path) -> None:
    # Item 2: the stack stops with the worker's one line, not a traceback.
    argv = [CONVEYOR, "up", "--port", str(free_port()), "--app", "mymodule:needy"]
    done = run(argv, folder, TMPDIR=str(tmp_path))
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "conveyor: stage 'needy': cannot build mymodule:Needy" in out, out
    assert "worker needy#0 exited (2)" in out, out
    assert "Traceback" not in out, out
    assert "ready:" not in out, out
    assert not list(tmp_path.glob("conveyor-redis-*")), out


def test_up_refuses_a_taken_port_before_anything_starts(folder: Path) -> None:
    # Item 5: `ready:` was printed although the gateway had failed to bind its port.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run([CONVEYOR, "up", "--port", str(port), "--pipelines", "echo"], folder)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line == (
        f"conveyor: the gateway cannot listen on 127.0.0.1:{port}: something else listens "
        "there; stop it, or pick another port (--port, CONVEYOR_PORT)"
    )
    assert "ready:" not in done.stdout
    assert "embedded redis" not in done.stdout


@pytest.mark.parametrize(
    ("argv", "url", "shown"),
    [
        (["status"], "redis://user:s3cret@127.0.0.1:{port}/0", "redis://user:***@127.0.0.1:"),
        (["status"], "redis://:s3cret@127.0.0.1:{port}/0?db=0", "redis://:***@127.0.0.1:"),
        (["dlq", "list", "echo"], "redis://user:s3cret@127.0.0.1:{port}/0", "user:***@"),
        (["status"], "redis+cluster://u:s3cret@127.0.0.1:{port}/0", "redis+cluster://u:***@"),
        (["status"], "redis://127.0.0.1:{port}/0?password=s3cret", "?password=***"),
    ],
)
def test_an_unreachable_redis_is_named_without_its_password(
    argv: list[str], url: str, shown: str
) -> None:
    # Item 6: `cannot reach Redis at redis://user:s3cret@...`.
    done = conveyor(*argv, CONVEYOR_REDIS_URL=url.format(port=free_port()))
    assert done.returncode == 2, done.stderr
    assert "s3cret" not in done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("conveyor: cannot reach Redis at "), line
    assert shown in line, line
    assert "(`conveyor up` prints its embedded one's as CONVEYOR_REDIS_URL=...)" in line


def test_redact_url_hides_every_password_and_keeps_the_rest() -> None:
    assert redact_url("redis://user:p%40ss@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact_url("redis://u:p@ss@host/0") == "redis://u:***@host/0"  # an unquoted @
    assert (
        redact_url("unix:///run/r.sock?db=1&Password=x") == "unix:///run/r.sock?db=1&Password=***"
    )
    for kept in ("redis://127.0.0.1:6379/0", "redis://user@host/0", "rediss://host/0?db=2"):
        assert redact_url(kept) == kept
    assert "secret" not in redact_url("redis://u:secret@[::1")  # unparseable: nothing shown


def test_the_gateway_url_is_one_a_browser_here_opens() -> None:
    assert gateway_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert gateway_url("0.0.0.0", 80) == "http://127.0.0.1:80"
    assert gateway_url("::", 8000) == "http://[::1]:8000"
    assert gateway_url("fe80::1", 8000) == "http://[fe80::1]:8000"


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        ("workers.py", ["--app", "workers:pipeline"]),
        ("pipelines/__init__.py", ["--app", "pipelines:pipeline"]),
        ("uvicorn.py", []),
        ("redis.py", ["--app", "mymodule:pipeline"]),
    ],
)
def test_a_module_named_like_one_conveyor_imports_is_one_line_before_anything_starts(
    folder: Path, name: str, argv: list[str]
) -> None:
    # Issue 28, a: a user's `workers.py` (or pipelines/, gateway.py...) in the folder up
    # runs in was hidden by conveyor's own package (up said it held no pipeline: it
    # did); a `uvicorn.py` (or redis.py, fastapi.py...) was imported by the gateway in
    # uvicorn's place, and up restarted it into a crash loop.
    (folder / name).parent.mkdir(exist_ok=True)
    (folder / name).write_text(APP)
    done = run([CONVEYOR, "up", "--port", str(free_port()), *argv], folder)
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.splitlines()
    module = name.removesuffix("/__init__.py")
    assert line.startswith(f"conveyor: {folder / module} is named like "), line
    assert line.endswith("rename it"), line
    assert "embedded redis" not in done.stdout  # nothing started


def test_a_gateway_that_cannot_import_what_it_runs_on_is_one_line(folder: Path) -> None:
    # Issue 28, a: `python -m gateway` run where a `uvicorn.py` hides uvicorn ended in a
    # traceback (status 1), which up restarted 5 times; now one line, status 2 (a
    # configuration error, which up does not restart).
    (folder / "uvicorn.py").write_text("raise RuntimeError('not uvicorn')\n")
    done = run([sys.executable, "-m", "gateway"], folder)
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"conveyor: {folder / 'uvicorn.py'} is named like "), line
