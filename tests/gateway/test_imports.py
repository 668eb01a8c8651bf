"""The gateway process never loads the Wikipedia client: only the worker running the fetch
step does.

A real ``python -X importtime -m gateway`` serves every built-in pipeline (wiki-summary
included), takes a wiki-summary job, renders its docs and status; the interpreter logs every
module it imports, whenever the import happens, so a lazy import on a request path counts too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.helpers import REPO, GatewayProcess

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


def test_the_gateway_process_does_not_import_the_wikipedia_client(
    redis_url: str, tmp_path: Path
) -> None:
    with GatewayProcess(redis_url, tmp_path / "gateway.log", "-X", "importtime") as gateway:
        base = gateway.base
        job = httpx.post(f"{base}/v1/jobs/wiki-summary", json={"search_term": "Alan Turing"})
        assert job.status_code == 202, job.text
        for path in ("/openapi.json", "/docs", "/status.json", "/metrics"):
            assert httpx.get(f"{base}{path}").status_code == 200, path
    modules = imported(gateway.log())
    assert "gateway" in modules, "no import log: the check would pass vacuously"
    assert not modules & SCRAPER, f"the gateway imported {sorted(modules & SCRAPER)}"
