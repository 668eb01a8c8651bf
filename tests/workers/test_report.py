"""What a published batch reports: the work's counts and histograms are held back and sent
with a later publish, at most ``stats_flush_s`` later, or when the worker is idle or
stops; the outcome counters go with every publish."""

from __future__ import annotations

import redis.asyncio as aioredis

from tests.helpers import Doubler, Harness, number_stage, until


async def test_a_batch_s_counts_are_held_back_until_the_worker_is_idle_or_stops(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage(max_batch_size=2, batch_wait_ms=0)
    # A read blocks 5 s when nothing comes: the worker is not idle again before that.
    worker = harness.worker(stage, Doubler(), stats_flush_s=60, block_ms=5000)
    await worker.start()
    await harness.enqueue("double", [{"value": i} for i in range(6)])
    running = harness.run(worker)

    async def answered() -> bool:
        return bool(await redis.xlen(harness.keys.reply_stream("test")) >= 6)

    await until(answered, 30)
    stats = await harness.stats("double")
    assert stats["items:ok"] == 6  # with every publish, under each request's marker
    # The first batch's counts went at once; the later ones are held back (one write a
    # flush_s, not one a batch).
    assert stats["batches"] == 1 < len(worker.history), stats
    worker.stop()
    await running
    stats = await harness.stats("double")
    assert stats["batches"] == len(worker.history) >= 3  # sent as it stopped
    assert stats["h:batch_size:count"] == stats["batches"]


async def test_an_idle_worker_sends_what_it_held_back(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage(batch_wait_ms=0)
    worker = harness.worker(stage, Doubler(), stats_flush_s=60)  # reads block 100 ms
    await worker.start()
    await harness.enqueue("double", [{"value": 1}])
    harness.run(worker)

    async def counted() -> bool:
        return (await harness.stats("double")).get("batches", 0) == 1

    await until(counted, 30)
