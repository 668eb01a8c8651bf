"""``/status`` and ``/status.json``: real workers, real Redis, and a real headless Chromium."""

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
import redis.asyncio as aioredis

from conveyor.embedded import free_port
from gateway.history import SAMPLE_S, quantile
from pipelines.builtin import builtin_pipelines
from pipelines.outcomes import Outcome
from pipelines.registry import Registry
from runtime.metrics import BUCKETS
from tests.helpers import REPO, Doubler, Harness, number_stage, until
from tests.support.browser import CHROMIUM, Chromium, chromium, open_page

ARTIFACTS = REPO / "test-artifacts"


async def test_status_json_counts_outcomes_and_shows_a_live_worker(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage(max_batch_size=8, batch_wait_ms=2)
    worker = harness.worker(stage, Doubler())
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([stage])
    resps = await asyncio.gather(*(http.post("/v1/double", json={"value": i}) for i in range(12)))
    assert [r.status_code for r in resps] == [200] * 12
    assert (await http.post("/v1/double", json={"value": 1, "fail": True})).status_code == 500
    await redis.xadd(harness.keys.dead_letters("double"), {"e": "{}"})
    # As a worker counts the items it skipped or discarded, cancelled.
    await redis.hincrby(harness.keys.stage_stats("double"), "items:cancelled", 2)

    resp = await http.get("/status.json")
    assert resp.status_code == 200
    assert resp.headers["cache-control"] == "no-store"
    snap = resp.json()
    assert abs(snap["time"] - time.time()) < 5
    [double] = snap["stages"]
    assert double["stage"] == "double"
    assert double["items"] == {"ok": 12, "error": 1, "expired": 0, "cancelled": 2}
    assert (double["lag"], double["pending"], double["dead_letters"]) == (0, 0, 1)
    assert double["lanes"] == {
        "interactive": {"lag": 0, "pending": 0},
        "bulk": {"lag": 0, "pending": 0},
    }
    [consumer] = double["consumers"]
    assert consumer["name"] == worker.consumer
    assert consumer["alive"] is True
    assert 0 <= consumer["idle_ms"] < 30_000
    assert consumer["pending"] == 0
    buckets = double["batch_size"]["buckets"]
    assert [le for le, _ in buckets] == [f"{b:g}" for b in BUCKETS["batch_size"]] + ["+Inf"]
    assert sum(n for _, n in buckets) == double["batches"] >= 1
    assert buckets[-1][1] == 0  # max_batch_size is 8: nothing in the larger buckets
    # 13 items ran, each estimated at 2 tokens (no text): nothing to pad.
    assert double["tokens"] == {"real": 26, "padded": 26}


def test_quantiles_interpolate_within_their_bucket() -> None:
    bounds = (1.0, 2.0, 4.0)
    assert quantile(bounds, [0, 10, 0, 0], 0.5) == 1.5  # half way through (1, 2]
    assert quantile(bounds, [10, 0, 0, 0], 0.99) == pytest.approx(0.99)
    assert quantile(bounds, [0, 0, 0, 5], 0.5) == 4.0  # past the last bound: that bound
    assert quantile(bounds, [0, 0, 0, 0], 0.5) is None


async def test_status_json_has_the_recent_past_and_latency_percentiles(
    harness: Harness,
) -> None:
    stage = number_stage(max_batch_size=1, batch_wait_ms=0)
    worker = harness.worker(stage, Doubler(delay_s=0.03))  # 30 ms of model time per batch
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([stage])
    for i in range(5):
        assert (await http.post("/v1/double", json={"value": i})).status_code == 200
    snap = (await http.get("/status.json")).json()
    [double] = snap["stages"]
    run = double["latency"]["run"]
    assert 0.025 <= run["p50"] <= 0.05  # within (25 ms, 50 ms], where 30 ms batches fall
    assert run["p50"] <= run["p99"] <= 0.05
    assert double["latency"]["queue_wait"]["p50"] < 0.25

    # The gateway read the counters at start and reads them every SAMPLE_S: the requests
    # above show up as a rate in the history within two readings.
    async def counted() -> bool:
        rates = (await http.get("/status.json")).json()["history"]
        return any(r > 0 for r in rates["stages"]["double"])

    await until(counted, limit_s=4 * SAMPLE_S)
    history = (await http.get("/status.json")).json()["history"]
    assert len(history["times"]) == len(history["stages"]["double"]) >= 1
    assert history["times"] == sorted(history["times"])


async def test_redis_down_is_a_503_and_the_page_still_renders(harness: Harness) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    http = await harness.gateway([number_stage()], redis_url=dead, redis_timeout_s=0.5)
    resp = await http.get("/status.json")
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "1"
    assert resp.json()["detail"] == "redis unreachable"
    page = await http.get("/status")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "<code>POST /v1/double</code>" in page.text
    assert 'href="/docs#/pipelines/post_double_v1_double_post"' in page.text
    # Self-contained: nothing is fetched from anywhere but this gateway.
    assert "://" not in page.text
    assert " src=" not in page.text


PAGE_STATE = """(() => {
  const main = document.getElementById("status");  // absent while the page is loading
  return JSON.stringify(main ? {
    ...main.dataset,
    stages: [...document.querySelectorAll("#stages tr")].map((tr) => tr.dataset.stage),
    outcomes: Object.fromEntries([...document.querySelectorAll("#stages tr")].map((tr) => [
      tr.dataset.stage,
      Object.fromEntries([...tr.querySelectorAll("[data-outcome]")].map(
        (td) => [td.dataset.outcome, td.textContent])),
    ])),
    lanes: Object.fromEntries([...document.querySelectorAll("#stages tr")].map((tr) => [
      tr.dataset.stage,
      [...tr.querySelectorAll("[data-lane]")].map((e) => `${e.dataset.field} ${e.textContent}`),
    ])),
    padding: Object.fromEntries([...document.querySelectorAll("#stages tr")].map((tr) => [
      tr.dataset.stage, tr.querySelector("[data-field=padding]")?.textContent ?? null,
    ])),
    latency: Object.fromEntries([...document.querySelectorAll("#stages tr")].map((tr) => [
      tr.dataset.stage,
      Object.fromEntries([...tr.querySelectorAll("[data-latency]")].map(
        (e) => [e.dataset.latency, e.textContent])),
    ])),
    headers: [...document.querySelectorAll("thead th")].map((th) => th.textContent),
    alive: document.querySelectorAll("[data-alive=true]").length,
    text: document.body.innerText,
  } : {state: "loading"});
})()"""


async def page_state(browser: Chromium, session: str) -> dict[str, Any]:
    """The page's data attributes, stage rows and text, as rendered now."""
    found = await browser.call(
        "Runtime.evaluate", session, expression=PAGE_STATE, returnByValue=True
    )
    state: dict[str, Any] = json.loads(found["result"]["value"])
    return state


async def wait_for(
    browser: Chromium, session: str, what: str, deadline_s: float, ok: Any
) -> dict[str, Any]:
    """Poll the page until ``ok(state)``; fail naming ``what`` and the last state."""
    give_up = time.monotonic() + deadline_s
    while True:
        state = await page_state(browser, session)
        if ok(state):
            return state
        if time.monotonic() > give_up:
            raise AssertionError(f"page never showed {what} in {deadline_s}s; last: {state}")
        await asyncio.sleep(0.2)


@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="the browser test needs Debian's chromium at /usr/bin/chromium "
    "(apt-get install -y chromium)",
)
async def test_status_page_refreshes_live_in_headless_chromium(
    harness: Harness, tmp_path: Path, redis: aioredis.Redis
) -> None:
    stages = [number_stage("double", max_batch_size=8, batch_wait_ms=2), number_stage("slow")]
    for stage, model in ((stages[0], Doubler()), (stages[1], Doubler(delay_s=0.02))):
        worker = harness.worker(stage, model)
        await worker.start()
        harness.run(worker)
    base = await harness.http_server(stages)
    await redis.hincrby(harness.keys.stage_stats("slow"), "items:cancelled", 3)
    # Padding efficiency: 75%, whatever the few items the test runs add (2 tokens each).
    await redis.hincrby(harness.keys.stage_stats("slow"), "tokens", 3_000_000)
    await redis.hincrby(harness.keys.stage_stats("slow"), "padded_tokens", 4_000_000)
    dead = f"redis://127.0.0.1:{free_port()}/0"
    down = await harness.http_server(stages, redis_url=dead, redis_timeout_s=0.5)

    stop = asyncio.Event()

    async def load(http: httpx.AsyncClient, name: str) -> None:
        while not stop.is_set():
            resp = await http.post(f"/v1/{name}", json={"value": 3})
            assert resp.status_code == 200, resp.text

    async with (
        httpx.AsyncClient(base_url=base, trust_env=False) as http,
        chromium(tmp_path) as browser,
    ):
        clients = [load(http, "double") for _ in range(6)] + [load(http, "slow")]
        loaders = [asyncio.create_task(c) for c in clients]

        async def recorded() -> bool:  # the gateway's history holds two readings with load
            rates = (await http.get("/status.json")).json()["history"]["stages"]["double"]
            return len([r for r in rates if r > 0]) >= 2

        try:
            await until(recorded, limit_s=6 * SAMPLE_S)
            session = await open_page(browser, f"{base}/status")
            # The recent past is on the chart from the first snapshot: two live snapshots
            # make one point, so two points after at most two refreshes came from history.
            first = await wait_for(
                browser, session, "a first snapshot", 10, lambda s: int(s.get("refreshes", 0)) >= 1
            )
            assert int(first["refreshes"]) <= 2, first
            assert int(first["points"]) >= 2, first
            assert float(first["throughput"]) > 0, first
            state = await wait_for(
                browser,
                session,
                "live refreshes with throughput",
                20,
                lambda s: (
                    s["state"] == "ok"
                    and int(s["refreshes"]) >= 4
                    and int(s["points"]) >= 2
                    and float(s["throughput"]) > 0
                ),
            )
            ARTIFACTS.mkdir(exist_ok=True)
            shot = await browser.call("Page.captureScreenshot", session, format="png")
            (ARTIFACTS / "status.png").write_bytes(base64.b64decode(shot["data"]))
        finally:
            stop.set()
            await asyncio.gather(*loaders)
        assert state["stages"] == ["double", "slow"]
        # A column per item outcome, cancelled included.
        assert list(state["outcomes"]["slow"]) == list(Outcome)
        assert state["outcomes"]["slow"]["cancelled"] == "3"
        assert state["outcomes"]["double"]["cancelled"] == "0"
        assert "cancelled" in state["headers"]
        assert "p50 / p99" in state["headers"]
        assert re.fullmatch(r"run [\d.,]+ ms / [\d.,]+ ms", state["latency"]["slow"]["run"])
        assert state["latency"]["slow"]["queue_wait"].startswith("wait ")
        assert state["padding"]["slow"] == "tokens 75% real"
        assert state["padding"]["double"] == "tokens 100% real"
        # Lag and pending per priority lane; the bulk lane is never used here.
        lanes = state["lanes"]["slow"]
        assert [entry.rsplit(" ", 1)[0] for entry in lanes] == [
            "lag interactive",
            "lag bulk",
            "pending interactive",
            "pending bulk",
        ]
        assert lanes[1] == "lag bulk 0"
        assert state["alive"] == 2  # one live worker per stage
        assert "Redis unreachable" not in state["text"]

        # A gateway whose Redis is down: the page says so and keeps polling.
        session = await open_page(browser, f"{down}/status")
        state = await wait_for(
            browser, session, "the Redis-down banner", 10, lambda s: s["state"] == "redis-down"
        )
        assert "Redis unreachable" in state["text"]
        shot = await browser.call("Page.captureScreenshot", session, format="png")
        (ARTIFACTS / "status-redis-down.png").write_bytes(base64.b64decode(shot["data"]))
        assert "POST /v1/double" in state["text"]  # the server-rendered pipeline list
        thrown = [e for e in browser.events if e.get("method") == "Runtime.exceptionThrown"]
        assert thrown == []


@pytest.fixture
def three_partitions(env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything built afterwards (the harness included) uses three partitions."""
    monkeypatch.setenv("CONVEYOR_PARTITIONS", "3")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (see above)")
@pytest.mark.usefixtures("three_partitions")
async def test_the_page_sums_the_partitions_and_says_so(harness: Harness, tmp_path: Path) -> None:
    registry = Registry(builtin_pipelines()).select(["chain"])
    await harness.start_workers(registry)  # a batch loop per partition
    base = await harness.http_server(registry)
    async with httpx.AsyncClient(base_url=base, trust_env=False) as http:
        # 30: every partition gets some but once in ~60,000 runs (ids are random).
        calls = [http.post("/v1/chain", json={"value": v}) for v in range(30)]
        assert {r.status_code for r in await asyncio.gather(*calls)} == {200}
    keys = harness.keys.each()
    spread = [await harness.redis.hget(k.stage_stats("adder"), "items:ok") for k in keys]
    assert all(spread), spread  # every partition answered some
    async with chromium(tmp_path) as browser:
        session = await open_page(browser, f"{base}/status")
        state = await wait_for(browser, session, "a snapshot", 10, lambda s: s["state"] == "ok")
    assert state["outcomes"]["adder"]["ok"] == "30"
    assert "3 partitions, summed" in state["text"]


def count(text: str) -> float:
    """A number as the page writes it ("1,234.5")."""
    return float(text.replace(",", ""))


RATES = """(() => {
  const main = document.getElementById("status");
  if (!main) return JSON.stringify({refreshes: 0});
  return JSON.stringify({
    refreshes: Number(main.dataset.refreshes),
    legend: [...document.querySelectorAll("#legend span")].map((e) => e.textContent),
    table: Object.fromEntries([...document.querySelectorAll("#stages tr")].map(
      (tr) => [tr.dataset.stage, tr.querySelector("td:last-child").textContent])),
  });
})()"""


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (see above)")
@pytest.mark.timeout(180)
async def test_a_stage_working_through_a_backlog_is_never_shown_at_0_per_s(
    harness: Harness, tmp_path: Path
) -> None:
    # BREAK (issue 29, Why 10): the legend showed "0/s" for a stage working through a
    # backlog: its items/s was the last interval between two polls (1.5 s), and a batch
    # that takes seconds finishes none in most of them.
    name = "wiki-summary.fetch"
    stage = number_stage(name, max_batch_size=32)
    worker = harness.worker(stage, Doubler(delay_s=3.0))  # a batch every 3 s, 32 at once
    await worker.start()
    harness.run(worker)
    await harness.enqueue(name, [{"value": 1}] * 2_000, deadline_in=600)  # minutes of work
    base = await harness.http_server([stage])
    rate = re.compile(rf"{re.escape(name)} ([\d,.]+)/s")

    async with chromium(tmp_path) as browser:
        sessions = [await open_page(browser, f"{base}/status", width=w) for w in (1400, 1920)]

        async def shown() -> list[tuple[int, float, float]]:
            """Each page's refresh count, its legend's and its table's items/s."""
            seen = []
            for session in sessions:
                found = await browser.call(
                    "Runtime.evaluate", session, expression=RATES, returnByValue=True
                )
                value = found["result"].get("value")  # none while the page is loading
                state: dict[str, Any] = json.loads(value) if value else {"refreshes": 0}
                if not state["refreshes"]:
                    return []
                legend = [m[1] for text in state["legend"] if (m := rate.fullmatch(text))]
                if not legend or name not in state["table"]:
                    return []
                seen.append((state["refreshes"], count(legend[0]), count(state["table"][name])))
            return seen

        # Once each page has seen the first batch done, its every refresh shows it working.
        async def started() -> bool:
            seen = await shown()
            return len(seen) == 2 and all(legend > 0 for _, legend, _ in seen)

        await until(started, limit_s=60)
        before = int((await harness.stats(name)).get("items:ok", 0))
        began = time.monotonic()
        samples: list[tuple[int, float, float]] = []
        last = [-1, -1]
        while min(last) < 0 or len(samples) < 16:  # 8 refreshes of each page: 12 s or more
            for i, seen in enumerate(await shown()):
                if seen[0] != last[i]:
                    last[i] = seen[0]
                    samples.append(seen)
            await asyncio.sleep(0.2)
        done = int((await harness.stats(name)).get("items:ok", 0)) - before
        measured = done / (time.monotonic() - began)
    async with httpx.AsyncClient(base_url=base, trust_env=False) as http:
        [row] = (await http.get("/status.json")).json()["stages"]
    assert row["lag"] > 0, row  # still working through its backlog
    zeros = [s for s in samples if s[1] == 0 or s[2] == 0]
    assert zeros == [], samples
    # Near what it does (within a factor of four either way: the page averages over the
    # last seconds, the batches are 32 at once).
    assert all(measured / 4 <= legend <= measured * 4 for _, legend, _ in samples), (
        measured,
        samples,
    )
