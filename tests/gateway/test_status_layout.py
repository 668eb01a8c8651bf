"""The status page at 1,400 and 1,920 px in a real headless Chromium (issue 29, item 12):
no column cut, every stage's line its own look, percentiles past the top bucket said as
such, and the gateway's own figures shown."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from runtime.metrics import le_label
from tests.browser import CHROMIUM, Chromium, chromium, open_page
from tests.helpers import Doubler, Harness, number_stage

LAYOUT = """(() => {
  const root = document.getElementById("status");
  if (Number(root.dataset.refreshes) < 2) return JSON.stringify({ready: false});
  const right = (e) => e.getBoundingClientRect().right;
  const lastCells = [...document.querySelectorAll("#stages tr td:last-child")];
  return JSON.stringify({
    ready: true,
    viewport: window.innerWidth,
    scroll: document.documentElement.scrollWidth,
    header: right([...document.querySelectorAll("thead th")].at(-1)),
    cells: Math.max(...lastCells.map(right)),
    rows: lastCells.length,
    legend: [...document.querySelectorAll("#legend [data-legend] i")].map(
      (i) => getComputedStyle(i).backgroundColor + "|" + getComputedStyle(i).borderTopColor
             + "|" + i.dataset.dash),
    figures: Object.fromEntries([...document.querySelectorAll("[data-figure]")].map(
      (e) => [e.dataset.figure, e.querySelector("b").textContent])),
    waits: [...document.querySelectorAll("[data-latency=queue_wait]")].map((e) => e.textContent),
  });
})()"""


async def layout(
    browser: Chromium, session: str, ready: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """What the page measures of itself once it has refreshed twice and ``ready`` holds."""
    for _ in range(300):
        found = await browser.call(
            "Runtime.evaluate", session, expression=LAYOUT, returnByValue=True
        )
        value = found["result"].get("value")  # none while the page is still loading
        state: dict[str, Any] = json.loads(value) if value else {"ready": False}
        if state["ready"] and ready(state):
            return state
        await asyncio.sleep(0.2)
    raise AssertionError(f"the page never refreshed twice: {state}")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
@pytest.mark.timeout(180)
async def test_the_page_fits_1400_and_1920_px_with_14_stages_and_the_gateway_figures(
    harness: Harness, tmp_path: Path, redis: aioredis.Redis
) -> None:
    # BREAK (issue 29, Why 10): at 1,400 px the items/s column was cut; 14 lines shared
    # 8 colours; a wait past the top bucket read "30,000 ms"; no gateway figures.
    stages = [number_stage(f"summary-chunked-{i:02d}") for i in range(14)]
    for stage in stages:
        worker = harness.worker(stage, Doubler(), consumer=None)
        await worker.start()
        harness.run(worker)
    base = await harness.http_server(stages)
    stats = harness.keys.stage_stats("summary-chunked-00")
    async with (
        httpx.AsyncClient(base_url=base, trust_env=False) as http,
        chromium(tmp_path) as browser,
    ):
        for width in (1400, 1920):
            session = await open_page(browser, f"{base}/status", width=width)
            await layout(browser, session, lambda _: True)
            # One stage's waits past the top bound (30 s), once the gateway has read its
            # counters: its p99 is "more than 30 s", not "30,000 ms".
            await redis.hincrby(stats, f"h:queue_wait_seconds:{le_label(float('inf'))}", 50)
            # Requests while the page watches: its figures are over its last minute.
            for name in ("summary-chunked-01", "summary-chunked-02"):
                resp = await http.post(f"/v1/{name}", json={"value": 2})
                assert resp.status_code == 200
            assert (await http.post("/v1/summary-chunked-01", json={})).status_code == 422

            def counted(state: dict[str, Any]) -> bool:
                figures = state["figures"]
                waits = state["waits"]
                return figures.get("4xx", "0/s") != "0/s" and ">30 s" in waits[0]

            got = await layout(browser, session, counted)
            assert got["viewport"] == width, got
            assert got["scroll"] <= width, got  # no horizontal overflow
            assert got["header"] <= width, got  # the items/s column is whole
            assert got["cells"] <= width, got
            assert got["rows"] == 14
            assert len(got["legend"]) == 14
            assert len(set(got["legend"])) == 14, got["legend"]  # each its own look
            assert set(got["figures"]) == {
                "requests",
                "4xx",
                "5xx",
                "latency",
                "restarts",
                "dead_letters",
                "redis_memory",
            }
            assert got["figures"]["redis_memory"].endswith("MiB"), got["figures"]
            assert got["figures"]["latency"] != "- / -", got["figures"]
            assert all("30,000 ms" not in w for w in got["waits"]), got["waits"]
