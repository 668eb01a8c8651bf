"""The gateway process never loads the Wikipedia client: only the worker running the fetch
step does.

A real ``python -X importtime -m gateway`` serves every built-in pipeline (wiki-summary
included), takes a wiki-summary job, renders its docs and status; the interpreter logs every
module it imports, whenever the import happens, so a lazy import on a request path counts too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import httpx

from conveyor.embedded import free_port
from tests.helpers import REPO, wait_ready

SCRAPER = {"wikipedia", "bs4", "requests"}
"""The fetch step's client and what it drags in."""


def imported(importtime_log: str) -> set[str]:
    """Top-level names of the modules an ``-X importtime`` log shows imported."""
    names = set()
    for line in importtime_log.splitlines():
        if line.startswith("import time:") and "|" in line:
            module = line.rsplit("|", 1)[1].strip()
            names.add(module.split(".")[0])
    return names


def test_the_check_sees_what_the_fetch_step_imports() -> None:
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import pipelines.builtin.wiki"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert imported(run.stderr) >= SCRAPER


def test_the_gateway_process_does_not_import_the_wikipedia_client(redis_url: str) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env |= {
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "CONVEYOR_REDIS_URL": redis_url,
        "CONVEYOR_NAMESPACE": f"imports{port}",
        "CONVEYOR_PORT": str(port),
    }
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "gateway"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=log,
        )

        def log_of(_: str) -> str:
            log.seek(0)
            return log.read().decode(errors="replace")

        try:
            wait_ready(base, {"gateway": proc}, log_of, limit_s=60)
            job = httpx.post(f"{base}/v1/jobs/wiki-summary", json={"search_term": "Alan Turing"})
            assert job.status_code == 202, job.text
            for path in ("/openapi.json", "/docs", "/status.json", "/metrics"):
                assert httpx.get(f"{base}{path}").status_code == 200, path
        finally:
            proc.terminate()
            proc.wait(timeout=20)
        modules = imported(log_of("gateway"))
    assert "gateway" in modules, "no import log: the check would pass vacuously"
    assert not modules & SCRAPER, f"the gateway imported {sorted(modules & SCRAPER)}"
