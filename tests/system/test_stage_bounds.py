"""A stage is bounded by itself, not by its callers: a model call that never returns ends
its worker after the stage's ``max_call_s`` whatever the requests' deadlines (a job's is
an hour), the input that hung is dead-lettered and its caller answered, and the stage
serves again. A paused worker is not taken for hung. Real worker processes, a real
gateway and a real redis-server.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.helpers import Harness, until
from tests.support.faultapp import HANGS, SLOW, spawn, stop
from workers.modelthread import HUNG_EXIT

FAST_RECLAIM = {
    "CONVEYOR_MIN_IDLE_MS": "300",
    "CONVEYOR_RECLAIM_INTERVAL_MS": "50",
    "CONVEYOR_BLOCK_MS": "100",
}


class Restarts:
    """Starts a worker process of one stage again whenever it exits, as ``up`` does."""

    def __init__(self, stage: str, log: Path, **env: str) -> None:
        self.stage, self.log, self.env = stage, log, env
        self.exits: list[int] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopping = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stopping.is_set() and len(self.exits) < 10:
            self.proc = spawn("workers", self.stage, log=self.log, **self.env)
            code = await asyncio.to_thread(self.proc.wait)
            if not self._stopping.is_set():
                self.exits.append(code)

    async def close(self) -> None:
        self._stopping.set()
        if self.proc is not None:
            await asyncio.to_thread(stop, self.proc)
        await self._task


@pytest.mark.timeout(180)
async def test_a_job_that_hangs_holds_its_stage_for_max_call_s_not_its_deadline(
    harness: Harness, redis: aioredis.Redis, tmp_path: Path
) -> None:
    # BREAK (round four, 1): one job whose input made a plain sync predict hang stopped its
    # stage for its deadline (an hour for a job) plus the grace: 13 of 13 later calls got
    # 504 and the worker was never restarted. Now the stage's max_call_s (2 s here) bounds
    # the call: the worker ends, the input that hung (alone in its batch) is
    # dead-lettered without running again, its job fails, and the stage serves.
    http = await harness.gateway([HANGS])
    workers = Restarts("hangs", tmp_path / "w.log", **FAST_RECLAIM)
    try:
        job = (await http.post("/v1/jobs/hangs", json={"value": -1})).json()
        view: dict[str, Any] = {}

        async def ended() -> bool:
            nonlocal view
            got = await http.get(f"/v1/jobs/{job['id']}")
            if got.status_code == 503:  # Redis did not answer in time (a loaded machine)
                assert "retry-after" in got.headers, got.text
                return False
            assert got.status_code == 200, (got.status_code, got.text)
            view = got.json()
            return view["status"] not in ("queued", "running")

        await until(ended, 90)
        assert view["status"] == "failed", view
        assert "max_call_s" in view["error"], view
        after = await http.post("/v1/hangs", json={"value": 4}, timeout=60)
        assert (after.status_code, after.json()) == (200, {"value": 8}), after.text
        assert workers.exits == [HUNG_EXIT], workers.exits  # one hang, never run again
        assert await redis.xlen(harness.keys.dead_letters("hangs")) == 1
    finally:
        await workers.close()
    log = (tmp_path / "w.log").read_text()
    assert "hung in its model call (launch)" in log, log


@pytest.mark.timeout(180)
async def test_the_input_that_hangs_is_found_by_halving_its_batch(
    harness: Harness, redis: aioredis.Redis, tmp_path: Path
) -> None:
    # The input that hung shared its batch: the batch runs again in halves until it is
    # alone; its batch-mates are answered, it alone is dead-lettered.
    http = await harness.gateway([HANGS])
    workers = Restarts("hangs", tmp_path / "w.log", **FAST_RECLAIM)
    try:
        await until(lambda: _reading(tmp_path / "w.log"), 60)
        headers = {"X-Conveyor-Timeout": "120"}
        values = [1, 2, -1, 3]
        calls = [http.post("/v1/hangs", json={"value": v}, headers=headers) for v in values]
        got = await asyncio.gather(*calls)
    finally:
        await workers.close()
    for value, resp in zip(values, got, strict=True):
        if value < 0:
            assert resp.status_code == 504, resp.text
            assert "max_call_s" in resp.json()["detail"], resp.text
        else:
            assert (resp.status_code, resp.json()) == (200, {"value": 2 * value}), resp.text
    assert await redis.xlen(harness.keys.dead_letters("hangs")) == 1
    # Its batch (as the window took them: up to 4) hung, then its half with -1, and so
    # on until -1 was alone: at most three hangs, each a restart.
    assert workers.exits in ([HUNG_EXIT], [HUNG_EXIT] * 2, [HUNG_EXIT] * 3), workers.exits


async def _reading(log: Path) -> bool:
    text = await asyncio.to_thread(lambda: log.read_text() if log.exists() else "")
    return " reading " in text


@pytest.mark.timeout(120)
async def test_a_paused_worker_is_not_taken_for_hung(
    harness: Harness, redis: aioredis.Redis, tmp_path: Path
) -> None:
    # BREAK (round four, lesser a): a worker SIGSTOPped for 45 s during a 3 s batch exited
    # 70 at SIGCONT: its watchdog counted the pause as the call's time. Only the time the
    # process ran counts now (here a 1 s batch, a 1.6 s bound on calls, a 4 s pause).
    http = await harness.gateway([SLOW])
    log = tmp_path / "w.log"
    env = FAST_RECLAIM | {"CONVEYOR_TEST_DELAY_S": "1", "CONVEYOR_MAX_CALL_S": "1.6"}
    proc = spawn("workers", "slow", log=log, **env)
    try:
        await until(lambda: _reading(log), 60)
        call = asyncio.create_task(http.post("/v1/slow", json={"value": 2}, timeout=60))
        on_model = harness.keys.on_model("*")
        await until(lambda: _exists(redis, on_model), 30)  # the batch is on the model
        proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(4)  # the pause itself is what is under test
        proc.send_signal(signal.SIGCONT)
        resp = await call
        assert (resp.status_code, resp.json()) == (200, {"value": 4}), resp.text
        assert proc.poll() is None, log.read_text()
    finally:
        stop(proc)


async def _exists(redis: aioredis.Redis, pattern: str) -> bool:
    return bool(await redis.keys(pattern))
