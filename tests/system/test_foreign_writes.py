"""Adversarial tests of what others write into the namespace (issue 28): keys of the
wrong type where a worker writes, stream ids that do not tell the time. Each FAILS on the
code it was written against; the comment on each states the break. Real redis-server,
real workers and a real gateway.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

from pipelines.envelope import FIELD, decode_request
from pipelines.errors import DETAIL_MAX
from pipelines.keys import GROUP
from pipelines.records import DeadLetter, JobField
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

    async def reported() -> bool:  # the answers may arrive before the worker's report
        return bool(worker.history)

    await until(reported, 30)
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


# --------------------------------------------------------------------------------------
# Break 4: stream ids taken for times.
# --------------------------------------------------------------------------------------

FUTURE_ID = "99999999999999-0"  # the year 5138


async def test_a_forged_future_id_does_not_drop_the_stage_s_requests(
    harness: Harness, redis: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # BREAK (issue 28, 4): after `XADD {ns}:stage:X 99999999999999-0 e junk`, Redis gives
    # every later `XADD *` an id after it; the worker took the id's time for the write
    # time, found it past each request's enqueue_by and dropped every sync request as
    # "arrived after its gateway refused it" (answered 504 at its deadline), until the
    # stream was deleted. A restore onto a host whose clock lags does the same. Expected:
    # requests are answered; the forged entry is dead-lettered; the stream's ids being
    # ahead is logged once by the worker and once by the gateway.
    caplog.set_level(logging.WARNING, logger="runtime.redisio")
    stage = number_stage()
    stream = harness.keys.stage_stream("double")
    http = await harness.gateway([stage])
    worker = harness.worker(stage, Doubler())
    await worker.start()
    await redis.xadd(stream, {"e": "junk"}, id=FUTURE_ID)
    harness.run(worker)
    timeout = {"X-Conveyor-Timeout": "20"}
    for i in range(3):
        answer = await http.post("/v1/double", json={"value": i}, headers=timeout)
        assert (answer.status_code, answer.json()) == (200, {"value": 2 * i}), answer.text
    answers = await asyncio.gather(
        *(http.post("/v1/double", json={"value": i}, headers=timeout) for i in range(8))
    )
    assert [a.status_code for a in answers] == [200] * 8, [a.text[:200] for a in answers]
    letters: list[Any] = await redis.xrange(harness.keys.dead_letters("double")) or []
    assert [fields[b"e"] for _, fields in letters] == [b"junk"]
    # Ids ahead of the clock are no arrival times: no batch waited a negative time.
    assert all(r.closed_at * 1000 - r.oldest_ms >= 0 for r in worker.history)
    told = [r.getMessage() for r in caplog.records if "ahead of the Redis clock" in r.getMessage()]
    assert len([m for m in told if m.startswith("stage double:") and stream in m]) == 1, told
    assert len([m for m in told if m.startswith("gateway:") and stream in m]) == 1, told


# --------------------------------------------------------------------------------------
# Lesser b: an error of any size read from Redis was served whole.
# --------------------------------------------------------------------------------------

HUGE = 5_000_000  # characters of a forged error message


async def test_a_huge_forged_error_is_served_cut_and_says_so(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # BREAK (issue 28, b): a 5 MB error in a forged reply (or job record) was returned
    # verbatim in the response's detail. Expected: at most DETAIL_MAX characters of it,
    # and the detail says how much was cut. Trigger: a call to a stage with no worker,
    # answered by a reply XADDed to its gateway's reply stream; a job whose record is
    # overwritten with such an error.
    stage = number_stage()
    http = await harness.gateway([stage])
    stream = harness.keys.stage_stream("double")
    timeout = {"X-Conveyor-Timeout": "20"}
    call = asyncio.create_task(http.post("/v1/double", json={"value": 1}, headers=timeout))
    found: list[Any] = []

    async def enqueued() -> bool:
        found[:] = await redis.xrange(stream) or []
        return bool(found)

    await until(enqueued, 10)
    request = decode_request(found[0][1])
    entry = {"v": 1, "id": request.id, "stage": "double", "outcome": "error", "status": 500}
    entry["error"] = "x" * HUGE
    await redis.xadd(request.reply_to, {FIELD: orjson.dumps(entry)})
    answer = await call
    assert answer.status_code == 500, answer.text[:200]
    detail = answer.json()["detail"]
    assert len(detail) < DETAIL_MAX + 200, len(detail)
    assert detail.endswith(f"[cut: {HUGE - DETAIL_MAX} more characters]"), detail[-100:]

    job_id = (await http.post("/v1/jobs/double", json={"value": 2})).json()["id"]
    await redis.hset(
        harness.keys.job(job_id),
        mapping={JobField.STATUS: "failed", JobField.ERROR: "y" * HUGE, JobField.HTTP_STATUS: 500},
    )
    view = (await http.get(f"/v1/jobs/{job_id}")).json()
    assert view["status"] == "failed", str(view)[:200]
    assert len(view["error"]) < DETAIL_MAX + 200, len(view["error"])
    assert view["error"].endswith(f"[cut: {HUGE - DETAIL_MAX} more characters]")
