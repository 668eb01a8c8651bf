"""Cancellation at the worker: a cancelled request is never started, the output of one
cancelled while its batch ran is discarded, and a cancelled stream stops streaming.

A request is cancelled by its marker (``records.mark_cancelled``), as the gateway sets it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from pipelines.envelope import Reply, Request, decode_replies
from pipelines.errors import Cancelled
from pipelines.graph import Pipeline, function
from pipelines.keys import GROUP
from pipelines.model import Item, Result
from pipelines.outcomes import CANCELLED, DONE, Outcome
from pipelines.records import JobRecord, job_cancelled
from pipelines.registry import Registry
from runtime.jobs import create_job, mark_cancelled
from runtime.redisio import enqueue
from runtime.status import stage_status
from tests.helpers import Doubler, Harness, NumberIn, number_stage, until
from tests.support.faultapp import spawn
from tests.workers.test_publish import publish_batch, read_batch
from workers.values import Effects, Outbox, Published


async def cancel(redis: aioredis.Redis, harness: Harness, req: Request) -> None:
    """Mark ``req`` cancelled, as the gateway does when its client goes away."""
    await mark_cancelled(redis, harness.keys, req.id, req.deadline, time.time())


async def replies(redis: aioredis.Redis, stream: str) -> list[Reply]:
    """Every reply written to ``stream`` so far, in order."""
    return [one for _, f in await redis.xrange(stream) or [] for one in decode_replies(f or {})]


async def test_a_request_cancelled_in_the_queue_is_not_run_and_the_rest_are(
    harness: Harness, redis: aioredis.Redis
) -> None:
    sent = await harness.enqueue("double", [{"value": v} for v in range(4)])
    await cancel(redis, harness, sent[2])
    model = Doubler()
    worker = harness.worker(number_stage(), model)
    await harness.run(worker, burst=True)

    by_id = {r.id: r for r in await replies(redis, harness.keys.reply_stream("test"))}
    assert model.batches == [[0, 1, 3]]  # one batch, without the cancelled one
    for req in (sent[0], sent[1], sent[3]):
        assert by_id[req.id].outcome == "ok"
        assert by_id[req.id].result == {"value": req.payload["value"] * 2}
    gone = by_id[sent[2].id]
    assert (gone.outcome, gone.http_status) == ("cancelled", Cancelled.status)
    assert gone.error == "cancelled before the step ran"
    stats = await harness.stats("double")
    assert (stats["items:ok"], stats["items:cancelled"], stats["model_items"]) == (3, 1, 3)
    assert [dict(+r.outcomes) for r in worker.history] == [{"ok": 3, "cancelled": 1}]
    pending = await redis.xpending(harness.keys.stage_stream("double"), GROUP)
    assert pending["pending"] == 0


class Gated:
    """Doubles ``value``; each batch waits until the test opens the gate."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()
        self.items = 0

    def predict(self, items: list[Item]) -> list[Result]:
        self.items += len(items)
        self.started.set()
        self.gate.wait(30)
        return [{"value": i["value"] * 2} for i in items]


async def test_output_of_a_request_cancelled_while_its_batch_ran_is_discarded(
    harness: Harness, redis: aioredis.Redis
) -> None:
    sent = await harness.enqueue("double", [{"value": v} for v in range(3)])
    model = Gated()
    worker = harness.worker(number_stage(), model)
    running = harness.run(worker, burst=True)
    await asyncio.to_thread(model.started.wait, 30)
    await cancel(redis, harness, sent[1])
    model.gate.set()
    await running

    got = await replies(redis, harness.keys.reply_stream("test"))
    assert sorted((r.id, r.outcome) for r in got) == sorted(
        [(sent[0].id, "ok"), (sent[2].id, "ok")]
    )  # nothing at all for the cancelled one: its client is gone
    stats = await harness.stats("double")
    assert (stats["items:ok"], stats["items:cancelled"], stats["model_items"]) == (2, 1, 3)
    assert "items:error" not in stats
    assert [dict(+r.outcomes) for r in worker.history] == [{"ok": 2, "cancelled": 1}]
    pending = await redis.xpending(harness.keys.stage_stream("double"), GROUP)
    assert pending["pending"] == 0  # acknowledged all the same


async def test_the_publish_script_discards_a_cancelled_requests_effects_once(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # One ran and was cancelled meanwhile (a job: its record, which its cancellation
    # wrote, is not written over); one was ended cancelled before running (what that
    # publishes is its cancellation); one was not cancelled.
    keys = harness.keys
    ids = await read_batch(redis, keys.stage_stream("s"), 3)
    await redis.hset(keys.job("ran"), mapping=job_cancelled())
    ok = Reply(id="ran", stage="s", outcome=Outcome.OK, result={"v": 1})
    ended = Reply(id="ended", stage="s", outcome=Outcome.CANCELLED, error="cancelled", status=499)
    other = Reply(id="other", stage="s", outcome=Outcome.OK, result={"v": 2})
    out = Outbox()
    for reply, to in ((ok, keys.job("ran")), (ended, keys.job("ended")), (other, keys.job("o"))):
        out.effects[keys.done(reply.id, "s")] = Effects(
            marker_ttl_s=60, replies=[(to, reply)], cancel_marker=keys.cancelled(reply.id)
        )
    for rid in ("ran", "ended"):
        await mark_cancelled(redis, keys, rid, time.time() + 60, time.time())
    extra: dict[str, Any] = {"job_prefix": keys.job_prefix}
    first = await publish_batch(redis, keys, out, ids, "first", 3, **extra)
    assert first == Published(0, frozenset({keys.done("ran", "s")}))
    retried = await publish_batch(redis, keys, out, ids, "first", 3, again=True, **extra)
    assert retried == first
    again = await publish_batch(redis, keys, out, ids, "second", 3, **extra)  # run twice
    assert again == Published(3, frozenset())

    records = {rid: JobRecord.parse(await redis.hgetall(keys.job(rid))) for rid in ("ran", "o")}
    assert records["ran"] == JobRecord(status=CANCELLED, error="cancelled", http_status=499)
    assert records["o"].status == DONE
    ended_record = JobRecord.parse(await redis.hgetall(keys.job("ended")))
    assert (ended_record.status, ended_record.http_status) == (CANCELLED, 499)
    stats = await harness.stats("s")
    assert (stats["items:ok"], stats["items:cancelled"]) == (1, 2)
    assert (await redis.xpending(keys.stage_stream("s"), GROUP))["pending"] == 0


class Steps:
    """Function steps ``a → b → c`` of pipeline ``chain``; ``b`` waits for the test's
    gate, and every call is recorded."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = {"a": [], "b": [], "c": []}
        self.b_started = threading.Event()
        self.gate = threading.Event()

    def step(self, name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
        def run(payload: dict[str, Any]) -> dict[str, Any]:
            self.calls[name].append(payload["value"])
            if name == "b":
                self.b_started.set()
                self.gate.wait(30)
            return {"value": payload["value"]}

        return run

    def registry(self) -> Registry:
        steps = (
            function("a", self.step("a"), then="b"),
            # One call at a time: a second job waits on b's stream while the first
            # runs; its cancellation is seen when it is read, before its call.
            function("b", self.step("b"), then="c", concurrency=1),
            function("c", self.step("c")),
        )
        return Registry([Pipeline("chain", NumberIn, steps)])


async def test_a_job_cancelled_mid_chain_never_reaches_its_next_step(
    harness: Harness, redis: aioredis.Redis
) -> None:
    steps = Steps()
    registry = steps.registry()
    workers = {}
    for name in ("a", "b", "c"):
        workers[name] = harness.worker(registry.stage(f"chain.{name}"), registry=registry)
        await workers[name].start()
        harness.run(workers[name])

    async def submit(value: int) -> Request:  # as the gateway submits a job
        rid = uuid.uuid4().hex
        req = harness.request(
            "chain", "chain.a", "a", {"value": value}, reply_to=harness.keys.job(rid)
        )
        req = req.model_copy(update={"id": rid})
        pipe = redis.pipeline(transaction=True)
        create_job(pipe, req, "owner", 600)
        enqueue(pipe, harness.keys, req)
        await pipe.execute()
        return req

    running = await submit(1)
    await asyncio.to_thread(steps.b_started.wait, 30)
    waiting = await submit(2)

    async def waiting_for_a_call() -> bool:  # on b's stream, behind the running one
        return bool(await redis.xlen(harness.keys.stage_stream("chain.b")) == 2)

    await until(waiting_for_a_call)
    # The running job is cancelled as DELETE /v1/jobs/{id} does (its record says so at
    # once); the waiting one by its marker alone: the worker ends it.
    pipe = redis.pipeline(transaction=True)
    mark_cancelled(pipe, harness.keys, running.id, running.deadline, time.time())
    pipe.hset(running.reply_to, mapping=job_cancelled())
    await pipe.execute()
    await cancel(redis, harness, waiting)
    steps.gate.set()

    async def both_cancelled_at_b() -> bool:
        return (await harness.stats("chain.b")).get("items:cancelled") == 2

    await until(both_cancelled_at_b)
    assert steps.calls["b"] == [1]  # the waiting one never ran
    assert await redis.xlen(harness.keys.stage_stream("chain.c")) == 0  # never handed on
    assert steps.calls["c"] == []
    assert (await harness.stats("chain.b"))["model_items"] == 1
    first = JobRecord.parse(await redis.hgetall(running.reply_to))
    assert (first.status, first.result) == (CANCELLED, None)
    second = JobRecord.parse(await redis.hgetall(waiting.reply_to))
    assert (second.status, second.result, second.http_status) == (CANCELLED, None, 499)
    assert second.error == "cancelled before the step ran"


async def test_a_cancelled_branch_fails_its_join(harness: Harness, redis: aioredis.Redis) -> None:
    # Cancelled after the fan-out, before its branches ran: each branch ends cancelled, the
    # join is marked failed (never fires), and the request is answered once.
    steps = (
        function("start", lambda p: p, then=("left", "right")),
        function("left", lambda p: p, then="join"),
        function("right", lambda p: p, then="join"),
        function("join", lambda p: p, join=("left", "right")),
    )
    registry = Registry([Pipeline("fan", NumberIn, steps)])
    req = harness.request("fan", "fan.start", "start", {"value": 1})
    await enqueue(redis, harness.keys, req)
    workers = {
        step: harness.worker(registry.stage(f"fan.{step}"), registry=registry)
        for step in ("start", "left", "right", "join")
    }
    await workers["start"].run(burst=True)
    await cancel(redis, harness, req)
    for step in ("left", "right", "join"):
        await workers[step].run(burst=True)

    got = await replies(redis, harness.keys.reply_stream("test"))
    assert [(r.id, r.outcome) for r in got] == [(req.id, "cancelled")]
    assert await redis.hget(harness.keys.join(req.id, "join"), "!failed") == b"1"
    assert await redis.xlen(harness.keys.stage_stream("fan.join")) == 0
    for step in ("left", "right"):
        stats = await harness.stats(f"fan.{step}")
        assert stats["items:cancelled"] == 1
        assert stats.get("model_items", 0) == 0


class Stepper:
    """Streams one more character to every item each time the test says so (a ``True``
    on ``steps``), and finishes at a ``None``."""

    def __init__(self) -> None:
        self.steps: queue.Queue[bool | None] = queue.Queue()

    def predict(self, items: list[Item]) -> list[Result]:
        return self.predict_stream(items, lambda i, t: None)

    def predict_stream(self, items: list[Item], emit: Callable[[int, str], None]) -> list[Result]:
        text = ""
        while self.steps.get(timeout=30):
            text += "x"
            for i in range(len(items)):
                emit(i, text)
        return [{"text": text} for _ in items]


async def test_a_cancelled_stream_stops_getting_partials(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stream = harness.keys.reply_stream("test")
    kept, dropped = (
        harness.request("gen", "gen", "gen", {"value": v}, stream=True) for v in (1, 2)
    )
    pipe = redis.pipeline(transaction=False)
    for req in (kept, dropped):
        enqueue(pipe, harness.keys, req)
    await pipe.execute()
    model = Stepper()
    worker = harness.worker(number_stage("gen", streaming=True), model)
    await worker.start()
    harness.run(worker)  # both in its first batch

    async def partials(req: Request) -> int:
        got = await replies(redis, stream)
        return sum(1 for r in got if r.id == req.id and r.outcome == "partial")

    async def step(n: int) -> None:  # one more character; wait until the kept one has it
        model.steps.put(True)

        async def arrived() -> bool:
            return await partials(kept) == n

        await until(arrived)

    await step(1)
    assert await partials(dropped) == 1
    mget_before = await mget_calls(redis)
    started = time.monotonic()
    await cancel(redis, harness, dropped)
    n = 1
    while await partials(dropped) == n:  # until the worker has seen the marker
        assert n < 1000, "still streaming a cancelled request"
        n += 1
        await step(n)
    seen = await partials(dropped)
    for _ in range(5):
        n += 1
        await step(n)
    assert await partials(dropped) == seen  # no more once stopped
    elapsed = time.monotonic() - started
    # Checked for the batch every 0.25 s at most, not per token (n tokens went out).
    assert await mget_calls(redis) - mget_before <= elapsed / 0.25 + 2 < n
    model.steps.put(None)

    async def finished() -> bool:
        return (await harness.stats("gen")).get("batches") == 1

    await until(finished)
    final = [(r.id, r.outcome) for r in await replies(redis, stream) if r.outcome != "partial"]
    assert final == [(kept.id, "ok")]
    stats = await harness.stats("gen")
    assert (stats["items:ok"], stats["items:cancelled"]) == (1, 1)


async def mget_calls(redis: aioredis.Redis) -> int:
    """How many MGETs the test's Redis has served so far."""
    info = await redis.info("commandstats")
    return int(info.get("cmdstat_mget", {}).get("calls", 0))


async def test_a_real_worker_never_runs_a_request_cancelled_in_its_queue(
    harness: Harness, redis: aioredis.Redis, tmp_path: Path
) -> None:
    # python -m workers, one item per batch, 0.3 s each: the first request occupies it
    # while the cancelled one waits in the stream.
    worker = spawn(
        "workers",
        "slow",
        log=tmp_path / "worker.log",
        CONVEYOR_TEST_DELAY_S="0.3",
        CONVEYOR_MAX_BATCH_SIZE="1",
        CONVEYOR_BLOCK_MS="100",
    )
    try:
        (first,) = await harness.enqueue("slow", [{"value": 1}])

        async def taken() -> bool:
            status = await stage_status(redis, harness.keys, "slow")
            return status.pending == 1 and status.lag == 0

        await until(taken)
        later = harness.request("slow", "slow", "slow", {"value": 2})
        await cancel(redis, harness, later)
        await enqueue(redis, harness.keys, later)
        (last,) = await harness.enqueue("slow", [{"value": 3}])

        async def answered() -> bool:
            return len(await replies(redis, harness.keys.reply_stream("test"))) == 3

        await until(answered)
    finally:
        worker.terminate()
        worker.wait(timeout=20)
    by_id = {r.id: r for r in await replies(redis, harness.keys.reply_stream("test"))}
    assert [by_id[r.id].outcome for r in (first, later, last)] == ["ok", "cancelled", "ok"]
    stats = await harness.stats("slow")
    assert (stats["model_items"], stats["items:ok"], stats["items:cancelled"]) == (2, 2, 1)
    assert "cancelled=1" in (tmp_path / "worker.log").read_text()
