"""The job record and the dead letter: what one side writes, the other reads back."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from pipelines.envelope import Reply, Request
from pipelines.keys import Keys
from pipelines.outcomes import DONE, EXPIRED, FAILED, QUEUED, Outcome
from pipelines.records import EXPIRED_ERROR, DeadLetter, JobField, JobRecord, Parked, job_finished
from runtime.jobs import create_job
from runtime.redisio import enqueue


async def test_a_job_is_created_with_its_request_and_a_repeat_keeps_its_end(
    redis: aioredis.Redis, namespace: str
) -> None:
    keys = Keys(namespace)
    request = Request(
        id="j1",
        pipeline="double",
        stage="double",
        step="double",
        payload={"value": 1},
        deadline=100.0,
        reply_to=keys.job("j1"),
    )
    done = Reply(id="j1", stage="double", outcome=Outcome.OK, result={"value": 2})
    for _ in range(2):  # the gateway's write, repeated after a lost answer
        pipe = redis.pipeline(transaction=True)
        create_job(pipe, request, "alice", 60)
        enqueue(pipe, keys, request)
        await pipe.execute()
        if JobRecord.parse(await redis.hgetall(keys.job("j1"))).status == QUEUED:
            await redis.hset(keys.job("j1"), mapping=job_finished(done))  # a worker's answer
    record = JobRecord.parse(await redis.hgetall(keys.job("j1")))
    assert record == JobRecord(
        status=DONE,
        pipeline="double",
        owner="alice",
        deadline=100.0,
        result='{"value":2}',
        http_status=200,
    )
    assert 0 < await redis.ttl(keys.job("j1")) <= 60
    assert await redis.xlen(keys.stage_stream("double")) == 2


@pytest.mark.parametrize(
    ("reply", "fields"),
    [
        (
            Reply(id="r", stage="s", outcome=Outcome.OK, result={"v": [1.5]}),
            {JobField.STATUS: DONE, JobField.RESULT: '{"v":[1.5]}', JobField.HTTP_STATUS: "200"},
        ),
        (
            Reply(id="r", stage="s", outcome=Outcome.ERROR, error="boom", status=503),
            {JobField.STATUS: FAILED, JobField.ERROR: "boom", JobField.HTTP_STATUS: "503"},
        ),
        (
            Reply(id="r", stage="s", outcome=Outcome.EXPIRED, error=None, status=504),
            {JobField.STATUS: EXPIRED, JobField.ERROR: "", JobField.HTTP_STATUS: "504"},
        ),
    ],
)
def test_a_finished_job_holds_what_its_sync_call_would_have_answered(
    reply: Reply, fields: dict[str, str]
) -> None:
    assert job_finished(reply) == fields
    assert JobRecord.parse(fields).http_status == reply.http_status


def test_the_view_of_a_job_follows_its_status() -> None:
    queued = JobRecord(status=QUEUED, pipeline="p", owner="o", deadline=100.0)
    assert queued.view("j", now=99.0) == {"id": "j", "pipeline": "p", "status": "queued"}
    expired = queued.view("j", now=101.0)
    assert expired == queued.view("j", now=99.0) | {
        "status": "expired",
        "error": EXPIRED_ERROR,
        "http_status": 504,
    }
    done = JobRecord(status=DONE, pipeline="p", result=orjson.dumps({"v": 1}).decode())
    assert done.view("j", now=1e12) == {
        "id": "j",
        "pipeline": "p",
        "status": "done",
        "result": {"v": 1},
    }
    failed = JobRecord(status=FAILED, pipeline="p", error="boom", http_status=422).view("j", 0)
    assert (failed["status"], failed["error"], failed["http_status"]) == (FAILED, "boom", 422)
    bare = JobRecord(status=FAILED, pipeline="p").view("j", now=0)  # no error nor status
    assert (bare["error"], bare["http_status"]) == ("", 500)


def test_only_its_owner_reads_a_job() -> None:
    assert JobRecord(status=QUEUED, pipeline="p", owner="alice").readable_by("alice")
    assert not JobRecord(status=QUEUED, pipeline="p", owner="alice").readable_by("bob")
    # From before jobs had owners: readable as it was; a late write alone: nobody's.
    assert JobRecord(status=QUEUED, pipeline="p").readable_by("bob")
    assert not JobRecord(status=DONE, result="1").readable_by("bob")
    assert not JobRecord().readable_by("bob")


async def test_a_dead_letter_reads_back_what_was_added_to_its_entry(
    redis: aioredis.Redis, namespace: str
) -> None:
    dlq = Keys(namespace).dead_letters("s")
    entry: dict[FieldT, EncodableT] = {b"e": b"{}"}
    added = DeadLetter(b"1-0", 3, "crashed").fields()
    assert all(isinstance(k, bytes) and k.startswith(DeadLetter.PREFIX) for k in added)
    await redis.xadd(dlq, entry | added)
    await redis.xadd(dlq, entry)  # an entry with nothing added (not a worker's)
    entries: Any = await redis.xrange(dlq)
    (_, letter), (_, bare) = entries
    assert DeadLetter.parse(letter) == DeadLetter(b"1-0", 3, "crashed")
    assert DeadLetter.parse(bare) == DeadLetter()


@pytest.mark.parametrize(
    "raw",
    [
        None,
        b"",
        b"not json",
        b"[1, 2]",
        b'{"reason": "r"}',
        b'{"reason": 5, "until": 10}',
        b'{"reason": "r", "until": true}',
        b'{"reason": "r", "until": -1}',
        b'{"reason": "r", "until": "soon"}',
        b'{"reason": "r", "until": 1e999}',
        b'{"reason": "' + b"x" * 5000 + b'", "until": 10}',
    ],
)
def test_a_parked_record_nobody_wrote_is_not_believed(raw: bytes | None) -> None:
    # Whatever the hash holds is untrusted: only what conveyor up writes parks a stage.
    assert Parked.parse(raw) is None


def test_a_parked_record_reads_back_bounded() -> None:
    written = Parked("crash loop " * 100, 1e12).encode()
    back = Parked.parse(written)
    assert back is not None
    assert len(back.reason) == Parked.MAX_REASON
    assert back.until == 1e10  # bounded where it enters
    assert back.left_s(1e10 + 1) == 0
