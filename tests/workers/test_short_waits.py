"""Short waits are the worker's to time, not Redis's, and the next batch is whole before the
model frees (issue 14: single-item batches that waited ~70 ms with a 5 ms window).

Redis times a blocked read out only at its timer tick (1000 / hz ms), so a BLOCK shorter
than that overshoots by up to a tick. The tests slow the tick to a second (``hz 1``), so a
wait left to Redis would take up to a second where the window asks for tens of ms.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from tests.helpers import Doubler, Harness, number_stage, until


@pytest.fixture
async def slow_tick(redis: aioredis.Redis) -> AsyncIterator[None]:
    """Redis's timer ticks once a second for the test (its default is 10 a second)."""
    before = str((await redis.config_get("hz"))["hz"])
    await redis.config_set("hz", 1)
    try:
        yield
    finally:
        await redis.config_set("hz", before)


@pytest.mark.usefixtures("slow_tick")
async def test_a_short_window_closes_on_time_not_at_redis_tick(harness: Harness) -> None:
    stage = number_stage(max_batch_size=16, batch_wait_ms=30)
    worker = harness.worker(stage, Doubler(), adaptive_batching=False)
    await worker.start()
    for value in range(3):  # each wait starts at a different phase of Redis's tick
        task = harness.run(worker, max_batches=1)
        await harness.enqueue("double", [{"value": value}])
        assert await task == 1
        record = worker.history[-1]
        waited_ms = record.closed_at * 1000 - record.oldest_ms
        # A BLOCK of the window's last ~30 ms would end at the next tick: 30-1030 ms.
        assert 30 - 2 <= waited_ms < 30 + 300


async def test_the_next_batch_is_whole_before_the_model_frees(harness: Harness) -> None:
    # Batches of 4, bulk's reserve 1: with no bulk work, interactive takes the reserve
    # too while batch 1 runs, so batch 2 closes full without waiting for the model.
    stage = number_stage(max_batch_size=4, batch_wait_ms=60_000)
    model = Doubler(delay_s=0.5)
    worker = harness.worker(
        stage, model, max_concurrent_batches=2, bulk_every=4, adaptive_batching=False
    )
    await worker.start()
    task = harness.run(worker, max_batches=2)
    await harness.enqueue("double", [{"value": v} for v in range(4)])
    await asyncio.to_thread(model.started.wait, 10)
    await harness.enqueue("double", [{"value": v} for v in range(10, 14)])

    async def second_waits_its_turn() -> bool:
        return worker.runner.busy == 2

    await until(second_waits_its_turn)  # batch 2 has closed, whole, while batch 1 runs
    assert model.batches == [[0, 1, 2, 3]]
    assert await task == 2
    assert model.batches == [[0, 1, 2, 3], [10, 11, 12, 13]]
