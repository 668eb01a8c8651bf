"""The batch loop with entries it cannot decode: answered, dead-lettered, never dropped."""

from __future__ import annotations

import asyncio
import itertools
import signal
import threading
import time
from pathlib import Path

import orjson
import pytest
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from conveyor.embedded import free_port, start_redis
from pipelines.envelope import FIELD, Request, decode_replies, dumps, encode
from pipelines.keys import Keys
from pipelines.model import Item, Result
from pipelines.settings import CommonSettings
from runtime.redisio import connect, text
from tests.helpers import Doubler, Harness, commands_seen, number_stage, replies_in, until
from workers.loop import Worker
from workers.settings import WorkerSettings


async def test_an_entry_from_another_version_is_answered_and_dead_lettered(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage()
    sent = await harness.enqueue("double", [{"value": v} for v in range(4)])
    good, skewed, as_job, foreign = sent
    stream = harness.keys.stage_stream("double")
    await redis.delete(stream)  # re-sent below, three of them in a future envelope version

    def newer(request_json: bytes, **changes: object) -> dict[FieldT, EncodableT]:
        raw = orjson.loads(request_json) | {"v": 2} | changes
        return {FIELD: orjson.dumps(raw)}

    job_key = harness.keys.job(as_job.id)
    await redis.hset(job_key, mapping={"status": "queued", "pipeline": "double", "deadline": "0"})
    await redis.xadd(stream, {FIELD: dumps(good)})
    await redis.xadd(stream, newer(dumps(skewed)))
    await redis.xadd(stream, newer(dumps(as_job), reply_to=job_key))
    await redis.xadd(stream, newer(dumps(foreign), reply_to="someone-elses:key"))
    worker = harness.worker(stage, Doubler())
    await harness.run(worker, burst=True)

    answered = await redis.xrange(harness.keys.reply_stream("test")) or []
    replies = [one for _, f in answered for one in decode_replies(f or {})]
    by_id = {r.id: r for r in replies}
    assert set(by_id) == {good.id, skewed.id}
    assert by_id[good.id].result == {"value": 0}
    assert by_id[skewed.id].outcome == "error"
    assert by_id[skewed.id].status == 500
    assert "dead-lettered" in (by_id[skewed.id].error or "")
    job = {text(k): text(v) for k, v in (await redis.hgetall(job_key)).items()}
    assert job["status"] == "failed"
    assert job["http_status"] == "500"
    assert not await redis.exists("someone-elses:key")  # no writes outside the namespace
    letters = await redis.xrange(harness.keys.dead_letters("double")) or []
    assert len(letters) == 3
    assert (await harness.stats("double"))["dead_letters"] == 3
    assert (await redis.xpending(stream, "workers"))["pending"] == 0


class Gated:
    """Doubles ``value``; the first batch waits until the test opens the gate."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()

    def predict(self, items: list[Item]) -> list[Result]:
        self.started.set()
        self.gate.wait(30)
        return [{"value": i["value"] * 2} for i in items]


@pytest.mark.parametrize("when", ["idle", "mid-batch"])
async def test_worker_outlives_a_redis_restart_that_lost_its_group(
    tmp_path: Path, namespace: str, when: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A restart without persistence (or a FLUSHALL, or a failover to a replica that never
    # had the group): the worker's read is refused with NOGROUP, and so is the heartbeat
    # of a batch running at that moment. The worker once died of either.
    port = free_port()
    server = start_redis(port, tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    client = connect(CommonSettings(redis_url=url))
    keys = Keys(namespace)
    # One batch at a time, so the read loop cannot re-create the group under a running
    # batch; heartbeats every 100 ms.
    settings = WorkerSettings(
        redis_url=url, namespace=namespace, block_ms=100, min_idle_ms=300, max_concurrent_batches=1
    )
    model = Gated()
    if when == "idle":
        model.gate.set()
    worker = Worker(number_stage(), settings, model)
    running = asyncio.create_task(worker.run())
    reply_stream = keys.reply_stream("test")

    async def send(value: int) -> None:
        request = Request(
            id=f"r{value}",
            pipeline="double",
            stage="double",
            step="double",
            payload={"value": value},
            state={"input": {"value": value}},
            deadline=time.time() + 60,
            reply_to=reply_stream,
        )
        await client.xadd(keys.stage_stream("double"), encode(request))

    async def answered(n: int) -> bool:
        return bool(await replies_in(client, reply_stream) >= n)

    async def heartbeat_refused() -> bool:
        return any("NOGROUP" in r.getMessage() for r in caplog.records)

    try:
        await send(1)
        if when == "idle":
            await until(lambda: answered(1), 30)
        else:
            await asyncio.to_thread(model.started.wait, 30)
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        server = start_redis(port, tmp_path)  # empty: no group, no stream
        await client.aclose()  # the test's own pooled connection died with the server
        client = connect(CommonSettings(redis_url=url))
        expected = [("r2", {"value": 4})]
        if when == "mid-batch":
            await until(heartbeat_refused, 30)
            model.gate.set()  # the batch ends after its group was lost: it still answers
            expected.insert(0, ("r1", {"value": 2}))
            await until(lambda: answered(1), 30)
        await send(2)
        await until(lambda: answered(len(expected)), 30)
        got = [
            one
            for _, f in await client.xrange(reply_stream) or []
            for one in decode_replies(f or {})
        ]
        assert [(r.id, r.result) for r in got] == expected
        assert not running.done()
    finally:
        model.gate.set()
        worker.stop()
        await asyncio.wait_for(running, 30)
        await worker.close()
        await client.aclose()
        server.terminate()
        server.wait(timeout=10)


async def test_one_client_behind_a_model_costs_one_read_a_batch(
    harness: Harness, redis: aioredis.Redis
) -> None:
    """Requests one at a time behind a 30 ms model: between one batch's claim and the
    next's, the worker reads once (a blocking read over its lanes, in place while the
    model runs), not a look every few milliseconds at a stream nothing can reach while
    the one client waits for its answer (round trips, and CPU beside the model's)."""
    on_model = harness.keys.on_model(harness.keys.stage_stream("double"))
    replies = harness.keys.reply_stream("test")
    async with commands_seen(redis) as seen:
        harness.run(harness.worker(number_stage(), Doubler(delay_s=0.03), block_ms=5000))
        for value in range(5):
            await harness.enqueue("double", [{"value": value}])

            async def answered(count: int = value + 1) -> bool:
                return await replies_in(redis, replies) >= count

            await until(answered, limit_s=30)
    claims = [i for i, words in enumerate(seen) if words[:2] == ["HSET", on_model]]
    assert len(claims) == 5, seen
    reads = [
        sum(1 for words in seen[start:end] if words[0].upper() == "XREADGROUP")
        for start, end in itertools.pairwise(claims)
    ]
    assert reads == [1, 1, 1, 1], reads
