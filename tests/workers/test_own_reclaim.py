"""A worker never takes back what it is running itself: entries look idle when their
lease could not touch them in time (a loaded host, an idle time set shorter than a touch
takes), and a reclaim of them would run them twice here and charge a crash that never
happened (a poison dead-lettered twice, its batch-mates run again)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import redis.asyncio as aioredis

from pipelines.keys import GROUP
from tests.helpers import Doubler, Harness, number_stage, replies_in, until
from workers.claims import Lease, claim_idle


async def _pending(redis: aioredis.Redis, stream: str) -> dict[bytes, tuple[str, int]]:
    rows: Any = await redis.xpending_range(stream, GROUP, min="-", max="+", count=100)
    return {r["message_id"]: (r["consumer"].decode(), int(r["times_delivered"])) for r in rows}


async def test_entries_a_lease_holds_are_not_taken_back_however_idle(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stream = harness.keys.stage_stream("s")
    await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for i in range(3):
        await redis.xadd(stream, {"e": str(i)})
    read: Any = await redis.xreadgroup(GROUP, "w1", {stream: ">"})
    ids = [eid for eid, _ in read[0][1]]
    held: Counter[bytes] = Counter()
    # A lease whose first touch is an hour away: the entries go idle under it.
    lease = Lease(redis, by_stream_ids(stream, ids[:2]), "w1", 3600.0, held)
    assert set(held) == set(ids[:2])
    await asyncio.sleep(0.02)

    got = await claim_idle(redis, harness.keys, stream, "w1", 5, 10, held=held)
    assert [e.id for e in got.waiting] == [ids[2]]  # only the one no lease holds
    pending = await _pending(redis, stream)
    assert all(pending[eid] == ("w1", 1) for eid in ids[:2])  # no delivery counted

    await lease.stop()
    assert not held  # the lease's ids are counted out when it stops
    await asyncio.sleep(0.02)
    got = await claim_idle(redis, harness.keys, stream, "w1", 5, 10, held=held)
    assert set(ids[:2]) <= {e.id for e in got.waiting}  # now they are anyone's


def by_stream_ids(stream: str, ids: list[bytes]) -> dict[str, list[bytes]]:
    return {stream: list(ids)}


async def test_a_worker_with_an_idle_time_shorter_than_its_batch_runs_it_once(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # 10 ms of idle time (the least allowed) and a reclaim every 10 ms against a 300 ms
    # batch: on a loaded host the lease falls behind, and before the guard the worker
    # took its own running entries back and ran them again (the first test pins the
    # guard itself; this one, the whole worker).
    stage = number_stage(max_batch_size=8, batch_wait_ms=20)
    model = Doubler(delay_s=0.3)
    worker = harness.worker(stage, model, min_idle_ms=10, reclaim_interval_ms=10)
    await worker.start()
    sent = await harness.enqueue("double", [{"value": i} for i in range(4)])
    stream = harness.keys.reply_stream("test")
    harness.run(worker)

    async def answered() -> bool:
        return await replies_in(redis, stream) >= len(sent)

    await until(answered, limit_s=30)
    # Fifty more reclaims: none may take back (and run again) what already ran.
    await asyncio.sleep(0.5)
    worker.stop()
    ran = [v for batch in model.batches for v in batch]
    assert sorted(ran) == list(range(4)), model.batches
    assert await replies_in(redis, stream) == len(sent)
