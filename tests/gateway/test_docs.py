"""``/docs`` and ``/redoc`` render with the network unreachable (a real headless Chromium)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import REPO, Harness, number_stage
from tests.support.browser import CHROMIUM, Chromium, chromium, open_page

ARTIFACTS = REPO / "test-artifacts"

RENDERED = """(() => JSON.stringify({
  swagger: [...document.querySelectorAll(".opblock-summary-path")].map((e) => e.textContent),
  redoc: [...document.querySelectorAll("[data-section-id^='operation/']")].length,
  title: document.title,
}))()"""


async def rendered(browser: Chromium, session: str, ok: Any, what: str) -> dict[str, Any]:
    """Poll the page until ``ok(state)``; fail naming ``what`` and the last state."""
    give_up = time.monotonic() + 20
    while True:
        found = await browser.call(
            "Runtime.evaluate", session, expression=RENDERED, returnByValue=True
        )
        state: dict[str, Any] = json.loads(found["result"]["value"])
        if ok(state):
            return state
        if time.monotonic() > give_up:
            raise AssertionError(f"{what} never rendered; last: {state}")
        await asyncio.sleep(0.2)


async def test_the_docs_pages_load_nothing_from_a_cdn(harness: Harness) -> None:
    http = await harness.gateway([number_stage()])
    for path in ("/docs", "/redoc"):
        page = await http.get(path)
        assert page.status_code == 200
        sources = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
        assert sources, page.text
        assert "cdn" not in page.text.lower()
        for url in sources:  # every script, stylesheet and icon is this gateway's own
            assert url.startswith("/"), url
            assert (await http.get(url)).status_code == 200, url
    assert (await http.get("/docs-assets/nothing.js")).status_code == 404


@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="the browser test needs Debian's chromium at /usr/bin/chromium "
    "(apt-get install -y chromium)",
)
async def test_docs_and_redoc_render_every_operation_offline(
    harness: Harness, tmp_path: Path
) -> None:
    base = await harness.http_server([number_stage()])
    async with (
        chromium(tmp_path) as browser,
        httpx.AsyncClient(base_url=base, trust_env=False) as http,
    ):
        paths = set((await http.get("/openapi.json")).json()["paths"])
        session = await open_page(browser, f"{base}/docs")
        swagger = await rendered(
            browser, session, lambda s: len(s["swagger"]) >= len(paths), "Swagger UI"
        )
        shot = await browser.call("Page.captureScreenshot", session, format="png")
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "docs.png").write_bytes(base64.b64decode(shot["data"]))
        session = await open_page(browser, f"{base}/redoc")
        redoc = await rendered(browser, session, lambda s: s["redoc"] > 0, "ReDoc")
    assert "/v1/double" in swagger["swagger"]
    assert set(swagger["swagger"]) == paths  # every operation of the document
    assert redoc["redoc"] >= len(paths)
    assert swagger["title"] == redoc["title"] == "conveyor: API docs"
