"""Liveness from the workers' own heartbeats, not Redis's idle time (issue 29, item 4):
a real worker process, real Redis (Debian's 7.0), the gateway's /metrics and /status.json,
and ``conveyor status``."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from pipelines.keys import GROUP
from runtime.redisio import text
from runtime.status import stage_status
from tests.helpers import Harness, conveyor, replies_in, until
from tests.support.faultapp import SLOW, spawn, stop

STALE_S = 3.0
"""The workers' stale window here: a worker silent this long is gone (default 30 s)."""


async def _counted(http: httpx.AsyncClient) -> tuple[int, bool]:
    """What the gateway says of stage ``slow``: live workers in /metrics, and whether
    /status.json shows its one consumer alive."""
    metrics = (await http.get("/metrics")).text
    line = next(
        m for m in metrics.splitlines() if m.startswith('conveyor_stage_consumers{stage="slow"}')
    )
    (row,) = (await http.get("/status.json")).json()["stages"]
    return int(float(line.split()[-1])), any(c["alive"] for c in row["consumers"])


@pytest.mark.timeout(240)
async def test_an_idle_worker_is_alive_a_paused_one_is_not(
    harness: Harness, redis: aioredis.Redis, tmp_path: Path
) -> None:
    # BREAK (issue 29, Why 4): alive was XINFO CONSUMERS' idle time under 30 s; on Redis
    # 7.0 that counts from the last entry delivered, so every quiet worker looked dead.
    log = tmp_path / "worker.log"
    worker = spawn("workers", "slow", log=log, CONVEYOR_ALIVE_STALE_S=str(STALE_S))
    try:
        http = await harness.gateway([SLOW])
        await harness.enqueue("slow", [{"value": 1}])

        async def answered() -> bool:
            return bool(await replies_in(redis, harness.keys.reply_stream("test")) >= 1)

        await until(answered, 120)  # loaded, joined, delivered one entry
        assert await _counted(http) == (1, True)
        stream = harness.keys.stage_stream("slow")

        async def redis_calls_it_idle() -> bool:  # what the old liveness went by
            consumers = await redis.xinfo_consumers(stream, GROUP)
            return all(int(c["idle"]) > 35_000 for c in consumers)

        idle_from = time.monotonic()
        await until(redis_calls_it_idle, 120)
        while time.monotonic() - idle_from < 60:  # idle a full minute, nothing delivered
            assert await _counted(http) == (1, True)
            await asyncio.sleep(0.5)  # a deliberate quiet minute, looked at twice a second
        status = await stage_status(redis, harness.keys, "slow")
        assert status.workers == 1
        assert [c.idle_ms > 30_000 for c in status.consumers] == [True]
        shown = conveyor("status", CONVEYOR_APP="tests.support.faultapp:pipelines")
        assert shown.returncode == 0, shown.stderr
        (row,) = [r for r in shown.stdout.splitlines() if r.startswith("slow ")]
        assert " 1/1 " in row, row
        assert "=alive" in row, row

        worker.send_signal(signal.SIGSTOP)  # paused: it no longer beats
        paused_at = time.monotonic()

        async def gone() -> bool:
            return await _counted(http) == (0, False)

        await until(gone, 60)
        # Within the stale window (and the time the gateway took to see it).
        assert time.monotonic() - paused_at < STALE_S + 30
        worker.send_signal(signal.SIGCONT)

        async def back() -> bool:
            return await _counted(http) == (1, True)

        await until(back, 60)
    finally:
        stop(worker)
    assert worker.returncode == 0, log.read_text(errors="replace")
    # An orderly stop removes its beat at once.
    assert not await redis.hgetall(harness.keys.alive("slow"))


async def test_forged_heartbeats_count_as_no_worker(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Whatever Redis holds is untrusted: a beat that is not a time, one in the past, a
    # name too long, or the key of another type count as no worker; a real beat does.
    key = harness.keys.alive("slow")
    now_ms = int(time.time() * 1000)
    await redis.hset(
        key,
        mapping={
            "nan": "nan",
            "huge": "9" * 40,
            "past": str(now_ms - 1000),
            "x" * 300: str(now_ms + 60_000),
            "real": str(now_ms + 60_000),
        },
    )
    status = await stage_status(redis, harness.keys, "slow")
    assert [(c.name, c.alive) for c in status.consumers] == [("real", True)]
    assert status.workers == 1
    await redis.delete(key)
    await redis.set(key, "not a hash")
    assert (await stage_status(redis, harness.keys, "slow")).workers == 0
    assert text(await redis.get(key)) == "not a hash"
