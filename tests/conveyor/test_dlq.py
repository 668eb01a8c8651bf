"""``conveyor dlq replay`` puts a letter back on the stream it was dead-lettered from."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from pipelines.envelope import Request, decode_request, encode, new_request_id
from pipelines.records import DeadLetter
from tests.helpers import Harness, conveyor


async def test_replay_goes_back_to_the_letters_stage_whatever_its_envelope_names(
    harness: Harness, redis: aioredis.Redis, redis_url: str, namespace: str
) -> None:
    # A worker reads no stage name from the envelope: an entry naming another stage ran
    # on the stream it was on, and was dead-lettered from there.
    payload = {"value": 1}
    request = Request(
        id=new_request_id(),
        pipeline="double",
        stage="elsewhere",
        step="double",
        payload=payload,
        state={"input": payload},
        deadline=time.time() + 60,
        reply_to=harness.keys.reply_stream("test"),
    )
    letter = {**encode(request), **DeadLetter(b"1-1", 3, "boom").fields()}
    await redis.xadd(harness.keys.dead_letters("double"), letter)
    env = {"CONVEYOR_REDIS_URL": redis_url, "CONVEYOR_NAMESPACE": namespace}
    done = await asyncio.to_thread(conveyor, "dlq", "replay", "double", **env)
    assert done.returncode == 0, done.stderr[-300:]
    stream = harness.keys.stage_stream("double")
    assert f"replayed 1 dead letter(s) to {stream}" in done.stdout
    assert await redis.exists(harness.keys.stage_stream("elsewhere")) == 0
    entries = await redis.xrange(stream) or []
    assert len(entries) == 1
    replayed = decode_request(entries[0][1] or {})
    assert (replayed.id, replayed.stage, replayed.attempt) == (request.id, "double", 1)
    assert await redis.xlen(harness.keys.dead_letters("double")) == 0
