"""Cancellation through the assembled stack: a real gateway process, a real worker process
of the built-in ``generate`` stage (a tiny causal LM), real HTTP clients that give up."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from pipelines.keys import Keys
from runtime.status import stage_status
from tests.helpers import REPO, GatewayProcess, until

CLIENTS = 64
BATCH = 8


def generate_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """A real ``python -m workers generate`` with ``env``, its output in ``log``."""
    with log.open("wb") as out:
        argv = [sys.executable, "-m", "workers", "generate"]
        return subprocess.Popen(argv, env=env, cwd=REPO, stdout=out, stderr=out)


async def test_clients_that_give_up_cost_at_most_the_batch_already_started(
    redis: aioredis.Redis, redis_url: str, cache_dir: Path, tmp_path: Path
) -> None:
    settings = {"CONVEYOR_PIPELINES": "generate", "CONVEYOR_CACHE_DIR": str(cache_dir)}
    with GatewayProcess(redis_url, tmp_path / "gateway.log", **settings) as gateway:
        env = gateway.env | {"CONVEYOR_MAX_BATCH_SIZE": str(BATCH)}
        worker = generate_worker(env, tmp_path / "worker.log")
        keys = Keys(env["CONVEYOR_NAMESPACE"])
        try:
            async with httpx.AsyncClient(base_url=gateway.base) as http:
                warm = await http.post("/v1/generate", json={"text": "hi"}, timeout=120)
                assert warm.status_code == 200, warm.text
                before = await redis.hgetall(keys.stage_stats("generate"))

                async def give_up(i: int) -> None:
                    body = {"text": f"story {i}", "max_new_tokens": 512}
                    try:
                        await http.post("/v1/generate", json=body, timeout=0.2)
                    except httpx.TimeoutException:
                        return
                    raise AssertionError("a 512-token generation answered within 0.2 s")

                await asyncio.gather(*(give_up(i) for i in range(CLIENTS)))

            async def settled() -> bool:  # every entry delivered and acknowledged
                status = await stage_status(redis, keys, "generate")
                return status.lag == 0 and status.pending == 0

            await until(settled, 120)
            after = await redis.hgetall(keys.stage_stats("generate"))
        finally:
            worker.terminate()
            worker.wait(timeout=30)

    def grew(field: bytes) -> int:
        return int(float(after.get(field, 0))) - int(float(before.get(field, 0)))

    ran = grew(b"model_items")
    # At most the batch already in the model when the clients left; the rest never ran.
    assert ran <= BATCH, (ran, (tmp_path / "worker.log").read_text()[-2000:])
    assert grew(b"items:cancelled") >= CLIENTS - BATCH
