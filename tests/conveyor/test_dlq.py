"""``conveyor dlq replay`` puts a letter back on the stream it was dead-lettered from."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from pipelines.envelope import Request, decode_request, encode, new_request_id
from pipelines.records import DeadLetter
from tests.helpers import Harness, beating, conveyor


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
    # No worker serves it yet: --force (test_replay_to_a_stage_no_worker_serves_needs_force).
    done = await asyncio.to_thread(conveyor, "dlq", "replay", "double", "--force", **env)
    assert done.returncode == 0, done.stderr[-300:]
    stream = harness.keys.stage_stream("double")
    assert f"replayed 1 dead letter(s) to {stream}" in done.stdout
    assert await redis.exists(harness.keys.stage_stream("elsewhere")) == 0
    entries = await redis.xrange(stream) or []
    assert len(entries) == 1
    replayed = decode_request(entries[0][1] or {})
    assert (replayed.id, replayed.stage, replayed.attempt) == (request.id, "double", 1)
    assert await redis.xlen(harness.keys.dead_letters("double")) == 0


async def test_replay_to_a_stage_no_worker_serves_needs_force(
    harness: Harness, redis: aioredis.Redis, redis_url: str, namespace: str
) -> None:
    # Before: the letters went onto a stream nobody reads, exit 0, not a word said.
    request = harness.request("double", "double", "double", {"value": 1})
    dlq, stream = harness.keys.dead_letters("double"), harness.keys.stage_stream("double")
    await redis.xadd(dlq, {**encode(request), **DeadLetter(b"1-1", 3, "boom").fields()})
    env = {"CONVEYOR_REDIS_URL": redis_url, "CONVEYOR_NAMESPACE": namespace}
    refused = await asyncio.to_thread(conveyor, "dlq", "replay", "double", **env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    (line,) = refused.stderr.splitlines()
    assert "no worker serves stage 'double'" in line, line
    assert "--force" in line, line
    assert await redis.xlen(dlq) == 1  # nothing moved
    assert await redis.exists(stream) == 0

    forced = await asyncio.to_thread(conveyor, "dlq", "replay", "double", "--force", **env)
    assert forced.returncode == 0, forced.stderr[-300:]
    assert f"replayed 1 dead letter(s) to {stream}" in forced.stdout
    (warning,) = forced.stderr.splitlines()
    assert "no worker serves stage 'double'" in warning, warning
    assert await redis.xlen(dlq) == 0
    assert await redis.xlen(stream) == 1

    # A live worker (its heartbeat): replayed without a word on stderr.
    await redis.xadd(dlq, {**encode(request), **DeadLetter(b"1-2", 3, "boom").fields()})
    await beating(redis, harness.keys, "double", "stand-in")
    served = await asyncio.to_thread(conveyor, "dlq", "replay", "double", **env)
    assert served.returncode == 0, served.stderr[-300:]
    assert f"replayed 1 dead letter(s) to {stream}" in served.stdout
    assert served.stderr == ""
