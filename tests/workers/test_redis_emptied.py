"""A Redis that comes back empty (restarted without persistence, or flushed) under a
running worker: the worker re-creates what it needs and goes on answering. Its duty of
taking back dead workers' entries asked XINFO CONSUMERS of a stream that was gone, which
Redis 7 refuses with "no such key" (not NOGROUP): the worker ended."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from tests.helpers import Doubler, Harness, number_stage, replies_in, until
from workers.places import take_from_dead


async def test_taking_back_from_dead_workers_of_a_stream_that_is_gone_takes_nothing(
    harness: Harness, redis: aioredis.Redis
) -> None:
    streams = [harness.keys.stage_stream("gone"), harness.keys.stage_stream("gone", "bulk")]
    claimed = await take_from_dead(redis, harness.keys, "gone", streams, "w1", 10)
    assert not claimed


async def test_a_worker_goes_on_answering_after_redis_is_emptied_under_it(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage(max_batch_size=4, batch_wait_ms=0)
    worker = harness.worker(stage, Doubler(), reclaim_interval_ms=10)
    await worker.start()
    running = harness.run(worker)
    stream, replies = harness.keys.stage_stream(stage.name), harness.keys.reply_stream("test")

    async def answered(n: int) -> bool:
        return await replies_in(redis, replies) >= n

    await harness.enqueue("double", [{"value": 1}])
    await until(lambda: answered(1), limit_s=30)
    await redis.flushall()

    async def regrouped() -> bool:  # the worker's next read made its group again
        try:
            return bool(await redis.xinfo_groups(stream))
        except Exception:
            return False

    await until(regrouped, limit_s=30)
    await asyncio.sleep(0.2)  # twenty of its reclaim duties over a stream set anew
    assert not running.done(), running.exception() if running.done() else None
    await harness.enqueue("double", [{"value": 2}])
    await until(lambda: answered(1), limit_s=30)  # the reply stream was flushed too
    assert not running.done()
    worker.stop()
