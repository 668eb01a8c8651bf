"""A job cancelled while its chain runs, with real processes: a gateway process, a worker
process serving the three steps of tests/support/faultapp.py's ``chain3``, the HTTP DELETE."""

from __future__ import annotations

from pathlib import Path

import httpx
import redis.asyncio as aioredis

from pipelines.keys import Keys
from runtime.status import stage_status
from tests.helpers import GatewayProcess, until
from tests.support.faultapp import spawn

STEPS = ("chain3.a", "chain3.b", "chain3.c")


async def test_a_job_cancelled_in_its_second_step_never_reaches_the_third(
    redis: aioredis.Redis, redis_url: str, tmp_path: Path
) -> None:
    app = {"CONVEYOR_APP": "tests.support.faultapp:pipelines", "CONVEYOR_PIPELINES": "chain3"}
    with GatewayProcess(redis_url, tmp_path / "gateway.log", **app) as gateway:
        namespace = gateway.env["CONVEYOR_NAMESPACE"]
        keys = Keys(namespace)
        started = tmp_path / "step-two-started"
        worker = spawn(
            "workers",
            ",".join(STEPS),
            log=tmp_path / "worker.log",
            CONVEYOR_REDIS_URL=redis_url,
            CONVEYOR_NAMESPACE=namespace,
            CONVEYOR_TEST_STEP_S="2",
            CONVEYOR_TEST_STARTED=str(started),
        )
        try:
            async with httpx.AsyncClient(base_url=gateway.base, timeout=30) as http:
                submitted = await http.post("/v1/jobs/chain3", json={"value": 1})
                assert submitted.status_code == 202, submitted.text
                job = submitted.json()["url"]

                # Running, not only read: a read entry is still checked for cancellation
                # before its batch runs, and a cancel landing then drops it unrun.
                async def in_step_two() -> bool:
                    return started.exists()

                await until(in_step_two, 60)
                cancelled = await http.delete(job)
                assert cancelled.status_code == 200, cancelled.text
                assert cancelled.json()["status"] == "cancelled"

                async def settled() -> bool:  # step two's batch finished and was acked
                    status = await stage_status(redis, keys, "chain3.b")
                    return status.lag == 0 and status.pending == 0

                await until(settled, 60)
                final = (await http.get(job)).json()
        finally:
            worker.terminate()
            worker.wait(timeout=30)
    assert final["status"] == "cancelled", final
    b_stats = await redis.hgetall(keys.stage_stats("chain3.b"))
    assert int(float(b_stats.get(b"model_items", 0))) == 1  # the running step finished
    assert int(float(b_stats.get(b"items:cancelled", 0))) == 1  # and its output was dropped
    for lane in ("interactive", "bulk"):
        assert await redis.xlen(keys.stage_stream("chain3.c", lane)) == 0
    assert await redis.hgetall(keys.stage_stats("chain3.c")) == {}
