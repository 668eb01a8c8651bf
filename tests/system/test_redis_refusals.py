"""Adversarial tests: Redis's own refusals, on a real redis-server of the test's own and
a real worker process. ``BUSY`` (a script past ``busy-reply-threshold``) and ``OOM``
(``maxmemory`` under ``noeviction``, the deployed policy) once stopped every worker
process and turned every gateway route into a 500. Now each is weathered like an
outage: the gateway answers 503 + Retry-After, a worker backs off and goes on, and every
request accepted is answered exactly once. Every wait is bounded and on a condition.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pipelines.keys import GROUP
from tests.helpers import Harness, until
from tests.support.faultapp import SLOW, spawn, stop


@pytest.fixture
async def admin(own_redis: subprocess.Popen[bytes]) -> AsyncIterator[aioredis.Redis]:
    """A plain client on the test's own Redis, outside every pool under test."""
    client = aioredis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])
    try:
        yield client
    finally:
        await client.config_set("maxmemory", 0)
        await client.aclose()


def worker(tmp_path: Path, delay_s: float = 0) -> subprocess.Popen[bytes]:
    """A real worker process of the ``slow`` stage (``delay_s`` a batch), logging to
    tmp_path."""
    return spawn(
        "workers",
        "slow",
        log=tmp_path / "worker.log",
        CONVEYOR_TEST_DELAY_S=str(delay_s),
        CONVEYOR_BLOCK_MS="100",
        CONVEYOR_REDIS_TIMEOUT_S="1",
    )


async def _refused_everywhere(http: httpx.AsyncClient, job: str, *, reads: bool = True) -> None:
    """Every route (that writes, unless ``reads``), while Redis refuses: 503 with a
    Retry-After, never a 500."""
    calls = {
        "call": http.post("/v1/slow", json={"value": 1}, headers={"X-Conveyor-Timeout": "2"}),
        "submit": http.post("/v1/jobs/slow", json={"value": 1}),
        "read": http.get(f"/v1/jobs/{job}"),
        "delete": http.delete(f"/v1/jobs/{job}"),
        "metrics": http.get("/metrics"),
        "status": http.get("/status.json"),
        "readyz": http.get("/readyz"),
    }
    got = dict(zip(calls, await asyncio.gather(*calls.values()), strict=True))
    for route, r in got.items():
        assert r.status_code != 500, (route, r.text)
        if not reads and route in ("read", "metrics", "status", "readyz"):
            continue  # Redis serves reads out of memory
        if route in ("metrics", "status") and r.status_code == 200:
            continue  # a page that says Redis is unavailable is an answer too
        assert r.status_code == 503, (route, r.status_code, r.text)
        assert "retry-after" in r.headers or route == "readyz", (route, r.headers)


async def _load(http: httpx.AsyncClient, n: int) -> list[httpx.Response]:
    """``n`` jobs submitted one after another (each 202 or a refusal)."""
    return [await http.post("/v1/jobs/slow", json={"value": v}) for v in range(n)]


async def _all_done(http: httpx.AsyncClient, accepted: list[httpx.Response]) -> None:
    """Every accepted job ends done, with its own value doubled."""

    async def done() -> bool:
        for r in accepted:
            if (await http.get(r.headers["location"])).json()["status"] != "done":
                return False
        return True

    await until(done, 60)
    for r in accepted:
        job = (await http.get(r.headers["location"])).json()
        assert job["result"] == {"value": 2 * job_value(r)}, job


def job_value(submitted: httpx.Response) -> int:
    sent: dict[str, Any] = json.loads(submitted.request.content)
    return int(sent["value"])


@pytest.mark.timeout(120)
async def test_a_busy_redis_is_weathered_by_gateway_and_worker(
    admin: aioredis.Redis, harness: Harness, tmp_path: Path
) -> None:
    # BREAK (issue 23, 2): BUSY made every worker process exit ("Redis refused the
    # command") and every gateway route answer 500 {"detail": "internal error"}.
    proc = worker(tmp_path, delay_s=0.3)  # a batch is running when Redis turns busy
    log = tmp_path / "worker.log"
    try:
        http = await harness.gateway([SLOW], redis_timeout_s=1)
        first = await http.post("/v1/slow", json={"value": 1}, headers={"X-Conveyor-Timeout": "60"})
        assert first.status_code == 200, first.text  # the worker is up
        await admin.config_set("busy-reply-threshold", 50)
        killer = aioredis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])
        await killer.ping()  # connected now: a new connection's handshake is refused BUSY
        before = await _load(http, 10)
        stream = harness.keys.stage_stream("slow", "bulk")  # a job's default lane

        async def running() -> bool:
            return bool((await admin.xpending(stream, GROUP))["pending"])

        await until(running, 10)

        async def spin() -> object:
            # A client of its own with no read timeout: the script runs as long as the
            # test takes (a busy machine), until the SCRIPT KILL below.
            spinner = aioredis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"], socket_timeout=None)
            try:
                return await spinner.eval("while true do end", 0)
            finally:
                await spinner.aclose()

        busy = asyncio.create_task(spin())

        async def refusing() -> bool:
            try:
                await killer.ping()
            except ResponseError as exc:
                return "BUSY" in str(exc)
            return False

        await until(refusing, 10)
        try:
            await _refused_everywhere(http, before[0].json()["id"])
            during = await _load(http, 5)

            async def worker_refused() -> bool:  # its batch's publish met BUSY
                return "publish refused (Redis is busy" in log.read_text()

            await until(worker_refused, 10)
        finally:
            await killer.script_kill()
            await killer.aclose()
            with pytest.raises(ResponseError):
                await busy
        assert {r.status_code for r in during} == {503}
        after = await _load(http, 10)
        assert {r.status_code for r in before + after} == {202}
        await _all_done(http, before + after)
        assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
    finally:
        stop(proc)


@pytest.mark.timeout(120)
async def test_redis_out_of_memory_refuses_new_work_and_loses_none_accepted(
    admin: aioredis.Redis, harness: Harness, tmp_path: Path
) -> None:
    # BREAK (issue 23, 2): OOM under maxmemory + noeviction (deploy/redis/redis.conf) made
    # every worker exit and every route a 500; accepted jobs sat queued until a restart.
    proc = worker(tmp_path, delay_s=0.2)  # batches still running when memory runs out
    try:
        http = await harness.gateway([SLOW], redis_timeout_s=1)
        first = await http.post("/v1/slow", json={"value": 1}, headers={"X-Conveyor-Timeout": "60"})
        assert first.status_code == 200, first.text
        await admin.config_set("maxmemory-policy", "noeviction")
        accepted = await _load(http, 20)
        assert {r.status_code for r in accepted} == {202}
        await admin.config_set("maxmemory", 1)  # every write that adds memory is refused
        try:
            refused = await _load(http, 5)
            for r in refused:
                assert r.status_code == 503, r.text
                assert "out of memory" in r.json()["detail"], r.text
                assert int(r.headers["retry-after"]) >= 1
            await _refused_everywhere(http, accepted[0].json()["id"], reads=False)
            # The worker's publishes are refused too: it backs off, holding its entries.
            await asyncio.sleep(1)  # a few of its back-off turns, bounded
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
        finally:
            await admin.config_set("maxmemory", 0)
        await _all_done(http, accepted)
        stats = await harness.stats("slow")
        assert stats["items:ok"] == len(accepted) + 1  # the first call too; none doubled
        assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
    finally:
        stop(proc)
