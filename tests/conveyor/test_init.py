"""``conveyor init [FOLDER]``: the folder it writes is served by ``conveyor up`` as
written (a real ``up``: its redis-server, gateway, workers), its ignore files keep the
data folder, secrets and virtualenvs out, and files that exist are not overwritten
without ``--force``."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from conveyor.embedded import free_port
from conveyor.init import APP, FILES
from tests.conveyor.test_cli import CONVEYOR
from tests.helpers import up_env, wait_for_line

pytestmark = pytest.mark.timeout(180)


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``conveyor ARGS`` in ``cwd``."""
    return subprocess.run(
        [CONVEYOR, *args], cwd=cwd, env=up_env(), capture_output=True, text=True, timeout=60
    )


def test_init_writes_an_app_that_up_serves_as_written(tmp_path: Path) -> None:
    # Before: `conveyor init` was an unknown command (exit 2, nothing written).
    done = run(tmp_path, "init", "proj")
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "proj"
    assert sorted(p.name for p in folder.iterdir()) == sorted(FILES)
    assert f"conveyor up --app {APP}" in done.stdout
    for ignore in (".gitignore", ".dockerignore"):
        lines = (folder / ignore).read_text().splitlines()
        for kept_out in (".conveyor/", ".env", ".venv/", "venv/"):
            assert kept_out in lines, (ignore, kept_out)
    port = free_port()
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [CONVEYOR, "up", "--app", APP, "--port", str(port)],
            cwd=folder,
            env=up_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for_line(log, "conveyor: ready:", proc, limit_s=120)
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/review", json={"text": "hello there"}, timeout=30
        )
        assert resp.status_code == 200, (resp.text, log.read_text())
        assert resp.json() == {"text": "hello there", "words": 2, "long": False}
        bad = httpx.post(f"http://127.0.0.1:{port}/v1/review", json={}, timeout=30)
        assert bad.status_code == 422, bad.text
        assert "text" in bad.text, bad.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, log.read_text()


def test_init_refuses_to_overwrite_unless_forced(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text("mine = 1\n")
    refused = run(tmp_path, "init")
    assert refused.returncode == 2
    assert "already has app.py" in refused.stderr
    assert "--force" in refused.stderr
    assert (tmp_path / "app.py").read_text() == "mine = 1\n"
    assert not (tmp_path / "README.md").exists()  # nothing written, not even the others
    forced = run(tmp_path, "init", "--force")
    assert forced.returncode == 0, forced.stderr
    assert (tmp_path / "app.py").read_text() == FILES["app.py"]
