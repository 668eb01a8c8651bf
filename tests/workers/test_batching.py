"""The batch window, the batch contract, and what a batch publishes (real Redis)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from pipelines.envelope import decode_replies
from pipelines.keys import GROUP
from tests.helpers import Doubler, Harness, WrongCount, number_stage


async def replies(redis: aioredis.Redis, harness: Harness) -> dict[str, dict[str, Any]]:
    entries = await redis.xrange(harness.keys.reply_stream("test"))
    out = {}
    for _, fields in entries or []:
        for reply in decode_replies(fields or {}):
            out[reply.id] = reply.model_dump()
    return out


async def test_full_batch_goes_at_once(harness: Harness) -> None:
    stage = number_stage(max_batch_size=4, batch_wait_ms=60_000)
    model = Doubler()
    await harness.enqueue("double", [{"value": i} for i in range(4)])
    worker = harness.worker(stage, model)
    assert await worker.run(max_batches=1) == 1
    (record,) = worker.history
    assert record.size == 4
    # A 60 s window was not waited for: a full batch closes at once.
    assert record.closed_at * 1000 - record.oldest_ms < 10_000
    assert model.batches == [[0, 1, 2, 3]]


@pytest.mark.parametrize("newer", [True, False])
async def test_a_batch_s_replies_share_an_entry_only_for_a_gateway_that_reads_so(
    harness: Harness, redis: aioredis.Redis, newer: bool
) -> None:
    # Issue 37: a batch's replies to one gateway are one entry (e, e1, ...), for requests
    # whose gateway says it reads them so (Request.reply_batches, set by this release's
    # gateway); an older gateway's requests get an entry each, which it reads as before
    # (it reads e alone).
    stage = number_stage(max_batch_size=4, batch_wait_ms=60_000)
    await harness.enqueue("double", [{"value": i} for i in range(4)], reply_batches=newer)
    assert await harness.worker(stage, Doubler()).run(max_batches=1) == 1
    entries = await redis.xrange(harness.keys.reply_stream("test")) or []
    assert [len(fields or {}) for _, fields in entries] == ([4] if newer else [1, 1, 1, 1])
    assert sorted(r["result"]["value"] for r in (await replies(redis, harness)).values()) == [
        0,
        2,
        4,
        6,
    ]


async def test_partial_batch_closes_when_window_ends(harness: Harness) -> None:
    stage = number_stage(max_batch_size=16, batch_wait_ms=400)
    worker = harness.worker(stage, Doubler(), adaptive_batching=False)
    await harness.enqueue("double", [{"value": i} for i in range(3)])
    assert await worker.run(max_batches=1) == 1
    (record,) = worker.history
    assert record.size == 3
    waited_ms = record.closed_at * 1000 - record.oldest_ms
    assert 400 - 2 <= waited_ms < 400 + 500


async def test_window_is_timed_from_oldest_arrival_not_from_read(harness: Harness) -> None:
    stage = number_stage(max_batch_size=16, batch_wait_ms=1000)
    worker = harness.worker(stage, Doubler(), adaptive_batching=False)
    await worker.start()  # model and connection ready, so reading starts at once below
    await harness.enqueue("double", [{"value": 1}])
    await asyncio.sleep(0.8)  # the entry ages before any worker reads it
    assert await worker.run(max_batches=1) == 1
    (record,) = worker.history
    waited_ms = record.closed_at * 1000 - record.oldest_ms
    # Closes ~1000 ms after arrival; a window started at read time would close >= 1800.
    assert 1000 - 2 <= waited_ms < 1500


async def test_window_does_not_restart_with_each_arrival(harness: Harness) -> None:
    stage = number_stage(max_batch_size=100, batch_wait_ms=1000)
    worker = harness.worker(stage, Doubler(), adaptive_batching=False)
    await worker.start()
    task = harness.run(worker, max_batches=1)
    await harness.enqueue("double", [{"value": 0}])
    for value in (1, 2):
        await asyncio.sleep(0.3)  # arrivals spread over the window
        await harness.enqueue("double", [{"value": value}])
    assert await task == 1
    (record,) = worker.history
    assert record.size == 3
    waited_ms = record.closed_at * 1000 - record.oldest_ms
    # A window restarted by the last arrival (+600 ms) would close >= 1600 ms.
    assert 1000 - 2 <= waited_ms < 1500


async def test_batch_waiting_for_a_busy_model_keeps_filling(harness: Harness) -> None:
    stage = number_stage(max_batch_size=16, batch_wait_ms=0)
    model = Doubler(delay_s=1.0)
    worker = harness.worker(stage, model, max_concurrent_batches=2, adaptive_batching=False)
    await worker.start()
    task = harness.run(worker, max_batches=2)
    await harness.enqueue("double", [{"value": 0}])
    await asyncio.to_thread(model.started.wait, 10)  # batch 1 holds the model now
    for value in range(1, 11):
        await harness.enqueue("double", [{"value": value}])
    assert await task == 2
    # With a 0 ms window batch 2 would close on its first item; since the model was busy
    # it kept taking arrivals and ran them together.
    assert model.batches == [[0], list(range(1, 11))]


async def test_results_acked_and_counted_in_one_go(harness: Harness, redis: aioredis.Redis) -> None:
    stage = number_stage(max_batch_size=8, batch_wait_ms=0)
    sent = await harness.enqueue("double", [{"value": i} for i in range(20)])
    worker = harness.worker(stage, Doubler())
    await worker.run(burst=True)
    got = await replies(redis, harness)
    assert {r.id: r.payload["value"] * 2 for r in sent} == {
        rid: r["result"]["value"] for rid, r in got.items()
    }
    pending = await redis.xpending(harness.keys.stage_stream("double"), GROUP)
    assert pending["pending"] == 0
    stats = await harness.stats("double")
    assert stats["items:ok"] == 20
    assert stats["batches"] == len(worker.history)
    assert stats["h:batch_size:count"] == len(worker.history)
    assert stats["h:queue_wait_seconds:count"] == 20


async def test_expired_entries_are_not_run(harness: Harness, redis: aioredis.Redis) -> None:
    stage = number_stage(max_batch_size=8, batch_wait_ms=0)
    model = Doubler()
    stale = await harness.enqueue("double", [{"value": 1}, {"value": 2}], deadline_in=-1)
    fresh = await harness.enqueue("double", [{"value": 3}])
    await harness.worker(stage, model).run(burst=True)
    got = await replies(redis, harness)
    assert [got[r.id]["outcome"] for r in stale] == ["expired", "expired"]
    assert got[fresh[0].id]["outcome"] == "ok"
    assert model.batches == [[3]]
    stats = await harness.stats("double")
    assert (stats["items:expired"], stats["items:ok"]) == (2, 1)


async def test_failing_item_fails_alone(harness: Harness, redis: aioredis.Redis) -> None:
    stage = number_stage(max_batch_size=8, batch_wait_ms=0)
    payloads = [{"value": i, "fail": i == 5} for i in range(8)]
    sent = await harness.enqueue("double", payloads)
    await harness.worker(stage, Doubler()).run(burst=True)
    got = await replies(redis, harness)
    outcomes = [got[r.id]["outcome"] for r in sent]
    assert outcomes == ["ok"] * 5 + ["error"] + ["ok"] * 2
    assert "poisoned item" in str(got[sent[5].id]["error"])
    assert [got[r.id]["result"] for r in sent if r.payload["value"] != 5] == [
        {"value": 2 * i} for i in range(8) if i != 5
    ]
    stats = await harness.stats("double")
    assert (stats["items:ok"], stats["items:error"]) == (7, 1)


async def test_batch_contract_is_enforced(harness: Harness, redis: aioredis.Redis) -> None:
    stage = number_stage(max_batch_size=4, batch_wait_ms=0)
    sent = await harness.enqueue("double", [{"value": i} for i in range(4)])
    await harness.worker(stage, WrongCount()).run(burst=True)
    got = await replies(redis, harness)
    for r in sent:
        assert got[r.id]["outcome"] == "error"
        assert "one result per item" in str(got[r.id]["error"])


@pytest.mark.parametrize(
    "raw",
    [
        {b"e": b"\x80\x04\x95\x00"},  # a pickle header: never unpickled, just refused
        {b"e": b'{"v": 99}'},
        {b"other": b"x"},
    ],
)
async def test_malformed_entry_is_dropped_without_harming_others(
    harness: Harness, redis: aioredis.Redis, raw: dict[FieldT, EncodableT]
) -> None:
    stage = number_stage(max_batch_size=8, batch_wait_ms=0)
    await redis.xadd(harness.keys.stage_stream("double"), raw)
    sent = await harness.enqueue("double", [{"value": 4}])
    await harness.worker(stage, Doubler()).run(burst=True)
    got = await replies(redis, harness)
    assert got[sent[0].id]["result"] == {"value": 8}
    pending = await redis.xpending(harness.keys.stage_stream("double"), GROUP)
    assert pending["pending"] == 0
    assert (await harness.stats("double"))["items:error"] == 1


async def test_two_workers_share_a_stage_without_duplicates(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage(max_batch_size=8, batch_wait_ms=0)
    sent = await harness.enqueue("double", [{"value": i} for i in range(200)])
    a = harness.worker(stage, Doubler(delay_s=0.005))
    b = harness.worker(stage, Doubler(delay_s=0.005))
    await asyncio.gather(a.start(), b.start())
    await asyncio.gather(a.run(burst=True), b.run(burst=True))
    ids_a = [i for rec in a.history for i in rec.request_ids]
    ids_b = [i for rec in b.history for i in rec.request_ids]
    assert ids_a
    assert ids_b
    assert sorted(ids_a + ids_b) == sorted(r.id for r in sent)  # each exactly once
    assert len(await replies(redis, harness)) == 200
    consumers = await redis.xinfo_consumers(harness.keys.stage_stream("double"), GROUP)
    assert len(consumers) == 2


async def test_adaptive_batch_goes_at_once_when_waiting_cannot_help(harness: Harness) -> None:
    stage = number_stage(max_batch_size=16, batch_wait_ms=2000)
    worker = harness.worker(stage, Doubler())  # adaptive by default
    await worker.start()
    for value in range(3):  # one request at a time, as a client at concurrency 1 sends
        await harness.enqueue("double", [{"value": value}])
        assert await worker.run(max_batches=1) == 1
    waits = [r.closed_at * 1000 - r.oldest_ms for r in worker.history]
    # a fixed window would hold each lone request for 2000 ms
    assert max(waits) < 500
