"""Adversarial tests of what others write into the namespace (issue 28): keys of the
wrong type where a worker writes, stream ids that do not tell the time. Each FAILS on the
code it was written against; the comment on each states the break. Real redis-server,
real workers and a real gateway.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import redis.asyncio as aioredis

from pipelines.keys import GROUP
from pipelines.records import DeadLetter
from tests.helpers import Doubler, Harness, number_stage, until

# --------------------------------------------------------------------------------------
# Break 5: a key of another type made the publish script fail midway.
# --------------------------------------------------------------------------------------


async def test_a_reply_key_of_another_type_dead_letters_its_request_alone(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # BREAK (issue 28, 5): a reply key of this namespace SET to a string (by anyone with
    # the credential) made the publish script fail with WRONGTYPE: the worker exited and
    # its 8 batch-mates were answered only once it had restarted, ~12 s later, and what
    # the script wrote before the error stayed. Expected: the culprit is dead-lettered,
    # nothing of it written; its batch-mates are answered at once and the worker serves
    # on. Trigger: a request replying to a string key, in one batch with 8 real calls.
    stage = number_stage(batch_wait_ms=5000, max_batch_size=9)
    http = await harness.gateway([stage])
    worker = harness.worker(stage, Doubler())
    await worker.start()  # its group exists: what is enqueued now waits for it
    bad = harness.keys.reply_stream("forged")
    await redis.set(bad, "not a stream")
    (culprit,) = await harness.enqueue("double", [{"value": -1}], reply_to=bad)
    timeout = {"X-Conveyor-Timeout": "30"}
    calls = [
        asyncio.create_task(http.post("/v1/double", json={"value": i}, headers=timeout))
        for i in range(8)
    ]
    stream = harness.keys.stage_stream("double")

    async def all_enqueued() -> bool:
        return bool(await redis.xlen(stream) == 9)

    await until(all_enqueued, 30)
    serving = harness.run(worker)  # its first read takes all nine: one batch
    answers: list[httpx.Response] = await asyncio.gather(*calls)
    assert [a.status_code for a in answers] == [200] * 8, [a.text[:200] for a in answers]
    assert [a.json() for a in answers] == [{"value": 2 * i} for i in range(8)]
    assert worker.history[0].size == 9  # they were the culprit's batch-mates
    assert not serving.done()
    again = await http.post("/v1/double", json={"value": 21}, headers=timeout)
    assert (again.status_code, again.json()) == (200, {"value": 42})
    # Nothing of the culprit's was written: its key as it was, no done marker.
    assert await redis.get(bad) == b"not a stream"
    assert await redis.exists(harness.keys.done(culprit.id, "double")) == 0
    letters: list[Any] = await redis.xrange(harness.keys.dead_letters("double")) or []
    assert len(letters) == 1
    error = DeadLetter.parse(letters[0][1]).error or ""
    assert bad in error, error
    assert "holds a string" in error, error
    stats = await harness.stats("double")
    assert (stats["items:ok"], stats["items:error"], stats["dead_letters"]) == (9, 1, 1)
    assert (await redis.xpending(stream, GROUP))["pending"] == 0
