"""The docs' "Your own pipelines" (docs/pipelines.md), as written (issue 25): its code blocks
copied into a module in an empty folder, served by ``conveyor up --app mymodule:pipeline`` run
there, and called over real HTTP. If the example stops working, this fails."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import httpx

from conveyor.embedded import free_port
from tests.conveyor.test_cli import CONVEYOR
from tests.helpers import REPO, up_env, wait_for_line


def readme_blocks() -> list[str]:
    """The python blocks of docs/pipelines.md's "Your own pipelines" section, in order."""
    text = (REPO / "docs" / "pipelines.md").read_text()
    section = text.split("\n## Your own pipelines\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_readme_pipeline_runs_as_written_from_an_empty_folder(tmp_path: Path) -> None:
    blocks = readme_blocks()
    assert len(blocks) >= 2, "the section lost its examples"
    assert all("from pipelines" not in block for block in blocks)  # `from conveyor import`
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "mymodule.py").write_text("\n\n".join(blocks))
    port = free_port()
    log = tmp_path / "up.log"
    argv = [CONVEYOR, "up", "--port", str(port), "--app", "mymodule:pipeline"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=folder, env=up_env(TMPDIR=str(tmp_path)), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_for_line(log, "conveyor: ready:", proc, limit_s=120)
        base = f"http://127.0.0.1:{port}"
        answer = httpx.post(
            f"{base}/v1/review",
            json={"text": "Angela Merkel visited Paris. The trip went well. Everyone was glad."},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        # The route decides: a negative mood ends the request early, anything else runs
        # both branches and joins them.
        assert body == {"skipped": True} or {"summary", "entities"} <= set(body), body
        counted = httpx.post(f"{base}/v1/review", json={"text": 7}, timeout=30)
        assert counted.status_code == 422, counted.text  # the README's input model holds
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    assert code == 0, log.read_text()
    assert "Traceback" not in log.read_text()
