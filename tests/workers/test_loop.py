"""The batch loop with entries it cannot decode: answered, dead-lettered, never dropped."""

from __future__ import annotations

import orjson
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from pipelines.envelope import FIELD, decode_reply, dumps
from pipelines.redisio import text
from tests.helpers import Doubler, Harness, number_stage


async def test_an_entry_from_another_version_is_answered_and_dead_lettered(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage()
    sent = await harness.enqueue("double", [{"value": v} for v in range(4)])
    good, skewed, as_job, foreign = sent
    stream = harness.keys.stage_stream("double")
    await redis.delete(stream)  # re-sent below, three of them as a newer gateway writes them

    def newer(request_json: bytes, **changes: object) -> dict[FieldT, EncodableT]:
        raw = orjson.loads(request_json) | {"priority": "interactive"} | changes
        return {FIELD: orjson.dumps(raw)}

    job_key = harness.keys.job(as_job.id)
    await redis.hset(job_key, mapping={"status": "queued", "pipeline": "double", "deadline": "0"})
    await redis.xadd(stream, {FIELD: dumps(good)})
    await redis.xadd(stream, newer(dumps(skewed)))
    await redis.xadd(stream, newer(dumps(as_job), reply_to=job_key))
    await redis.xadd(stream, newer(dumps(foreign), reply_to="someone-elses:key"))
    worker = harness.worker(stage, Doubler())
    await harness.run(worker, burst=True)

    answered = await redis.xrange(harness.keys.reply_stream("test")) or []
    replies = [decode_reply(f or {}) for _, f in answered]
    by_id = {r.id: r for r in replies}
    assert set(by_id) == {good.id, skewed.id}
    assert by_id[good.id].result == {"value": 0}
    assert by_id[skewed.id].outcome == "error"
    assert by_id[skewed.id].status == 500
    assert "dead-lettered" in (by_id[skewed.id].error or "")
    job = {text(k): text(v) for k, v in (await redis.hgetall(job_key)).items()}
    assert job["status"] == "failed"
    assert job["http_status"] == "500"
    assert not await redis.exists("someone-elses:key")  # no writes outside the namespace
    letters = await redis.xrange(harness.keys.dead_letters("double")) or []
    assert len(letters) == 3
    assert (await harness.stats("double"))["dead_letters"] == 3
    assert (await redis.xpending(stream, "workers"))["pending"] == 0
