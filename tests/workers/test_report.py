"""What a published batch reports: the work's counts and histograms are held back and sent
with a later publish, at most ``stats_flush_s`` later, or when the worker is idle or
stops; the outcome counters go with every publish."""

from __future__ import annotations

import redis.asyncio as aioredis

from runtime.redisio import RedisClock
from tests.helpers import Doubler, Harness, number_stage, until
from workers.contract import Breaches
from workers.report import Reporter, Summary
from workers.values import Batch, BatchRecord, Outbox


def _batch() -> Batch:
    record = BatchRecord(size=2, oldest_ms=0, closed_at=0.0, run_s=0.01)
    return Batch([], record, [0.1, 0.2], Outbox())


def test_a_batch_s_counts_are_held_back_and_go_together() -> None:
    report = Reporter("s", "c", RedisClock(), Summary("s", 0), Breaches("s", "r"), dict, 60)
    first, _ = report.counts(_batch())
    assert first["batches"] == 1  # the first goes at once
    for _ in range(3):  # the next ones, within flush_s, are held back
        later, gauges = report.counts(_batch())
        assert "batches" not in later, later
        assert gauges is None
    held, _ = report.held()
    assert held["batches"] == 3
    assert held["h:batch_size:count"] == 3
    report.unsent(held)  # a publish of them failed: held again, not lost
    again, _ = report.held()
    assert again == held
    assert report.held() == ({}, None)  # nothing held: nothing to send


async def test_a_worker_that_stops_sends_what_it_held_back(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage(max_batch_size=2, batch_wait_ms=0)
    worker = harness.worker(stage, Doubler(), stats_flush_s=60)
    await worker.start()
    await harness.enqueue("double", [{"value": i} for i in range(6)])
    await worker.run(burst=True)  # until nothing is left
    stats = await harness.stats("double")
    assert stats["items:ok"] == 6  # with every publish, under each request's marker
    assert stats["batches"] == len(worker.history) >= 3  # all of them, as it stopped
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
