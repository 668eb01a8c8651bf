"""Priority lanes on the worker side: both lane streams read, interactive first, bulk never
starved, and every delivery guarantee (reclaim, delivery cap and replay, drain, trim) kept
per lane. Real Redis, real workers; waits are on conditions."""

from __future__ import annotations

import time
from typing import Any, cast

import redis.asyncio as aioredis

from pipelines.builtin import ADDER, MULTIPLIER, builtin_pipelines
from pipelines.envelope import Request, decode_replies, decode_request
from pipelines.keys import GROUP, LANES, Lane
from pipelines.registry import Registry
from runtime.jobs import mark_cancelled
from runtime.redisio import enqueue
from tests.helpers import Doubler, Harness, conveyor, died_running, number_stage, until
from workers.loop import Worker
from workers.models.toy import Adder, Multiplier

Entry = tuple[bytes, dict[bytes, bytes]]


async def send(
    harness: Harness,
    lane: Lane,
    values: list[int],
    *,
    pipeline: str = "double",
    stage: str = "double",
    step: str = "double",
) -> list[Request]:
    """XADD requests of ``lane`` to their stage's lane stream, as a gateway would."""
    requests = [harness.request(pipeline, stage, step, {"value": v}, lane=lane) for v in values]
    pipe = harness.redis.pipeline(transaction=False)
    for r in requests:
        enqueue(pipe, harness.keys, r)
    await pipe.execute()
    return requests


async def replies(redis: aioredis.Redis, harness: Harness) -> list[dict[str, Any]]:
    stream = harness.keys.reply_stream("test")
    return [
        one.model_dump()
        for _, f in await redis.xrange(stream) or []
        for one in decode_replies(f or {})
    ]


def streams(harness: Harness, stage: str = "double") -> dict[Lane, str]:
    return {lane: harness.keys.stage_stream(stage, lane) for lane in LANES}


async def test_a_batch_takes_interactive_first_and_fills_with_bulk(harness: Harness) -> None:
    model = Doubler()
    stage = number_stage(max_batch_size=4, batch_wait_ms=0)
    await send(harness, "bulk", [1, 2, 3])  # bulk arrived first: it still waits
    await send(harness, "interactive", [101, 102, 103])
    worker = harness.worker(stage, model, bulk_every=1000, adaptive_batching=False)
    assert await worker.run(max_batches=3, burst=True) == 3
    # Interactive first; bulk fills its reserve (one slot) while interactive is active.
    assert model.batches == [[101, 102, 103, 1], [2], [3]]


async def test_bulk_fills_whole_batches_once_interactive_is_quiet(harness: Harness) -> None:
    model = Doubler()
    stage = number_stage(max_batch_size=4, batch_wait_ms=0)
    await send(harness, "bulk", list(range(8)))
    worker = harness.worker(stage, model, bulk_every=4, adaptive_batching=False)
    assert await worker.run(max_batches=2, burst=True) == 2
    assert model.batches == [[0, 1, 2, 3], [4, 5, 6, 7]]


async def test_bulk_keeps_its_share_of_every_batch_under_full_interactive_load(
    harness: Harness,
) -> None:
    # bulk_every=4, batches of 4: one slot of each batch is bulk's while it has work.
    model = Doubler()
    stage = number_stage(max_batch_size=4, batch_wait_ms=0)
    await send(harness, "interactive", list(range(100, 140)))
    await send(harness, "bulk", list(range(6)))
    worker = harness.worker(stage, model, bulk_every=4, adaptive_batching=False)
    assert await worker.run(max_batches=8, burst=True) == 8
    bulk_per_batch = [sum(1 for v in b if v < 100) for b in model.batches]
    assert [len(b) for b in model.batches] == [4] * 8
    assert bulk_per_batch == [1] * 6 + [0, 0]  # then interactive takes the reserve too


async def test_a_bulk_request_runs_and_is_answered(harness: Harness, redis: aioredis.Redis) -> None:
    sent = await send(harness, "bulk", [5])
    worker = harness.worker(number_stage(batch_wait_ms=0), Doubler())
    await worker.run(burst=True)
    got = await replies(redis, harness)
    assert [(r["id"], r["outcome"], r["result"]) for r in got] == [
        (sent[0].id, "ok", {"value": 10})
    ]
    assert (await redis.xpending(streams(harness)["bulk"], GROUP))["pending"] == 0


async def test_a_cancelled_bulk_request_is_not_run(harness: Harness, redis: aioredis.Redis) -> None:
    model = Doubler()
    cancelled, kept = await send(harness, "bulk", [1, 2])
    await mark_cancelled(redis, harness.keys, cancelled.id, cancelled.deadline, time.time())
    await harness.worker(number_stage(batch_wait_ms=0), model).run(burst=True)
    assert model.batches == [[2]]
    got = {r["id"]: r["outcome"] for r in await replies(redis, harness)}
    assert got == {cancelled.id: "cancelled", kept.id: "ok"}


async def test_a_chain_keeps_the_bulk_lane(harness: Harness, redis: aioredis.Redis) -> None:
    registry = Registry(builtin_pipelines()).select(["chain"])
    (sent,) = await send(harness, "bulk", [1], pipeline="chain", stage="adder", step="add")
    await harness.worker(ADDER, Adder(), registry).run(burst=True)
    multiplier = streams(harness, "multiplier")
    assert await redis.xlen(multiplier["interactive"]) == 0
    handed = cast(list[Entry], await redis.xrange(multiplier["bulk"]))
    assert [decode_request(f).lane for _, f in handed] == ["bulk"]
    await harness.worker(MULTIPLIER, Multiplier(), registry).run(burst=True)
    got = await replies(redis, harness)
    assert [(r["id"], r["result"]) for r in got] == [(sent.id, {"value": 4})]


async def test_a_join_keeps_the_bulk_lane(harness: Harness, redis: aioredis.Redis) -> None:
    registry = Registry(builtin_pipelines()).select(["broadcast"])
    pipeline = registry.pipeline("broadcast")
    first, join = pipeline.step("start"), pipeline.step("collect")
    (sent,) = await send(
        harness, "bulk", [3], pipeline="broadcast", stage=first.stage.name, step="start"
    )
    await harness.start_workers(registry)

    async def answered() -> bool:
        return bool(await replies(redis, harness))

    await until(answered, 30)
    (reply,) = await replies(redis, harness)
    assert (reply["id"], reply["outcome"]) == (sent.id, "ok")
    joined = streams(harness, join.stage.name)
    assert await redis.xlen(joined["bulk"]) >= 1  # the join's envelope went to bulk
    held = cast(list[Entry], await redis.xrange(joined["bulk"]))
    envelopes = [decode_request(f) for _, f in held]
    assert {(e.step, e.lane) for e in envelopes if e.id == sent.id} >= {("collect", "bulk")}


async def test_a_dead_workers_bulk_entry_is_reclaimed_and_answered(
    harness: Harness, redis: aioredis.Redis
) -> None:
    bulk = streams(harness)["bulk"]
    (sent,) = await send(harness, "bulk", [7])
    worker = harness.worker(
        number_stage(batch_wait_ms=0), Doubler(), min_idle_ms=50, reclaim_interval_ms=10
    )
    await worker.start()  # the groups exist: a worker takes the entry, then dies
    assert await redis.xreadgroup(GROUP, "crashed-worker", {bulk: ">"})
    harness.run(worker)

    async def answered() -> bool:
        return bool(await replies(redis, harness))

    await until(answered, 30)
    got = await replies(redis, harness)
    assert [(r["id"], r["result"]) for r in got] == [(sent.id, {"value": 14})]
    assert (await redis.xpending(bulk, GROUP))["pending"] == 0


async def test_a_bulk_entry_delivered_too_often_is_dead_lettered_and_replayed_to_bulk(
    harness: Harness, redis: aioredis.Redis
) -> None:
    lanes = streams(harness)
    dlq = harness.keys.dead_letters("double")
    stage = number_stage(batch_wait_ms=0)
    (sent,) = await send(harness, "bulk", [4])
    worker = harness.worker(stage, Doubler(), max_deliveries=1, min_idle_ms=10)
    await worker.start()
    assert await died_running(redis, harness.keys, lanes["bulk"])  # died running it

    async def lettered() -> bool:
        await worker.run(max_batches=1, burst=True)
        return worker.parts.recovery.dead_lettered >= 1

    await until(lettered, 30)
    assert (await redis.xpending(lanes["bulk"], GROUP))["pending"] == 0  # acked on bulk
    ((letter_id, letter),) = cast(list[Entry], await redis.xrange(dlq) or [])
    assert decode_request(letter).lane == "bulk"
    done = conveyor("dlq", "replay", "double", "--force")  # its worker starts after
    assert f"replayed 1 dead letter(s) to {lanes['bulk']}" in done.stdout, done.stderr
    back = cast(list[Entry], await redis.xrange(lanes["bulk"], min=f"({letter_id.decode()}"))
    assert [decode_request(f).id for _, f in back] == [sent.id]
    assert await redis.xlen(lanes["interactive"]) == 0
    await harness.worker(stage, Doubler()).run(burst=True)
    got = await replies(redis, harness)
    assert [r["result"] for r in got if r["outcome"] == "ok"] == [{"value": 8}]


async def test_drain_leaves_both_groups(harness: Harness, redis: aioredis.Redis) -> None:
    await send(harness, "interactive", [1])
    await send(harness, "bulk", [2])
    worker = harness.worker(number_stage(batch_wait_ms=0), Doubler())
    running = harness.run(worker)

    async def answered() -> bool:
        return len(await replies(redis, harness)) == 2

    await until(answered, 30)
    for stream in streams(harness).values():
        assert [c["name"] for c in await redis.xinfo_consumers(stream, GROUP)] == [
            worker.consumer.encode()
        ]
    worker.stop()
    await running
    for stream in streams(harness).values():
        assert await redis.xinfo_consumers(stream, GROUP) == []


async def test_trim_trims_both_lanes(harness: Harness, redis: aioredis.Redis) -> None:
    await redis.config_set("stream-node-max-entries", 4)
    await send(harness, "interactive", list(range(20)))
    await send(harness, "bulk", list(range(20)))
    stage = number_stage(max_batch_size=10, batch_wait_ms=0)
    worker: Worker = harness.worker(stage, Doubler(), trim_interval_s=0.001)
    await worker.run(burst=True)  # all done and acked
    assert len(await replies(redis, harness)) == 40

    async def trimmed() -> bool:
        await worker.run(burst=True)  # each run's first look trims, when due
        lengths = [await redis.xlen(s) for s in streams(harness).values()]
        return all(n <= 4 for n in lengths)

    await until(trimmed, 30)


async def test_slots_held_by_running_sequences_count_against_each_lanes_share(
    harness: Harness,
) -> None:
    # Continuous decoding (workers/decoding.py) reads into a running batch, not a new one:
    # the bulk work already running holds bulk's reserve, so while interactive work comes
    # a read takes no more bulk, however many slots are free.
    stage = number_stage(max_batch_size=4)
    worker = harness.worker(stage, Doubler(), bulk_every=4)  # reserve: one slot of four
    await worker.parts.source.ensure_stream()
    await send(harness, "interactive", [101])
    await send(harness, "bulk", [1, 2, 3])
    lanes = worker.parts.lanes
    lanes.seated(0, 0)
    first = await lanes.read(2, None)  # the interactive request, and bulk's reserve
    assert sorted(e.stream for e in first) == sorted(streams(harness).values())
    lanes.assembled()  # not a batch: what the read took now runs beside the next read's
    lanes.seated(1, 1)  # both run: bulk holds its reserve
    assert await lanes.read(2, None) == []  # interactive is active: no more bulk


async def test_a_look_at_both_lanes_is_one_round_trip_and_keeps_their_shares(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Issue 37: the lanes are read in one round trip (a pipeline of two XREADGROUPs), not
    # one each; Redis's count of socket reads says how many the look made. The shares are
    # those of two reads in turn: interactive within its room, bulk within its reserve.
    stage = number_stage(max_batch_size=4)
    worker = harness.worker(stage, Doubler(), bulk_every=4)  # reserve: one slot of four
    await worker.parts.source.ensure_stream()
    await send(harness, "interactive", list(range(100, 110)))
    await send(harness, "bulk", list(range(10)))
    lanes = worker.parts.lanes

    async def reads() -> int:
        return int((await redis.info("stats"))["total_reads_processed"])

    before = await reads()
    first = await lanes.read(4, None)
    after = await reads()
    assert after - before == 2  # the look, and the INFO that counts it
    values = [decode_request(e.fields).payload["value"] for e in first]
    assert values == [100, 101, 102, 0]  # interactive's room (three), bulk's reserve (one)
    lanes.assembled()
    # Interactive is active: bulk keeps to its reserve however much room is left.
    await redis.delete(*[s for lane, s in streams(harness).items() if lane == "interactive"])
    await worker.parts.source.ensure_stream()
    second = await lanes.read(4, None)
    assert [decode_request(e.fields).payload["value"] for e in second] == [1]
