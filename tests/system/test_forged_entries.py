"""Adversarial tests, third pass: forged stream entries. Whatever an entry on a stage
stream holds, it is dead-lettered, its caller is answered when the entry names a reply
address of the namespace, and the stage keeps serving: on first delivery (intake) and
when a reclaim finds it past the delivery cap (recovery). Each forged shape here
killed every worker of its stage, for good, on the code these tests were written against.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from pipelines.envelope import FIELD, decode_replies
from pipelines.keys import GROUP
from pipelines.tokens import COST
from tests.helpers import Doubler, Harness, number_stage, until

STAGE = number_stage("poison")


def _envelope(rid: str, reply_to: str, **changes: Any) -> dict[str, Any]:
    env: dict[str, Any] = {
        "v": 1,
        "id": rid,
        "pipeline": STAGE.name,
        "stage": STAGE.name,
        "step": STAGE.name,
        "payload": {"value": 1},
        "deadline": time.time() + 60,
        "reply_to": reply_to,
    }
    env.update(changes)
    return env


# Each one decodes as JSON (orjson writes neither Infinity nor NaN, so those go as text);
# the numbers are out of every range the worker computes with.
FORGED: dict[str, dict[str, str | float]] = {
    "infinite deadline": {"deadline": "Infinity"},
    "minus infinite deadline": {"deadline": "-Infinity"},
    "NaN deadline": {"deadline": "NaN"},
    "deadline past any expiry": {"deadline": 1e300},
    "infinite enqueue_by": {"enqueue_by": "Infinity"},
    "huge attempt": {"attempt": "1" + "0" * 40},
    "infinite input": {"payload": '{"value":Infinity}'},
    "integer input past 64 bits": {"payload": '{"value":' + "9" * 30 + "}"},
    "huge integer in the state": {"state": '{"input":{"value":1},"x":' + "9" * 30 + "}"},
}


def _forge(rid: str, reply_to: str, case: str) -> dict[bytes, bytes]:
    changes = FORGED[case]
    # Written as raw JSON text: numbers pydantic's decoder reads and orjson won't write.
    body = orjson.dumps(_envelope(rid, reply_to, **{k: f"@{k}@" for k in changes}))
    for name, value in changes.items():
        body = body.replace(f'"@{name}@"'.encode(), str(value).encode())
    return {FIELD: body, COST: b"4"}


async def _reply(redis: aioredis.Redis, stream: str, rid: str) -> Any:
    for _, fields in await redis.xrange(stream) or []:
        for reply in decode_replies(fields or {}):
            if reply.id == rid:
                return reply
    return None


async def _served(harness: Harness, redis: aioredis.Redis, reply_to: str) -> None:
    """A valid request after the poison is answered: the stage still serves."""
    [good] = await harness.enqueue(STAGE.name, [{"value": 21}], reply_to=reply_to)

    async def answered() -> bool:
        return await _reply(redis, reply_to, good.id) is not None

    await until(answered, 30)
    reply = await _reply(redis, reply_to, good.id)
    assert reply.outcome == "ok"
    assert reply.result == {"value": 42}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(FORGED))
async def test_a_forged_entry_is_dead_lettered_answered_and_the_stage_serves_on(
    harness: Harness, redis: aioredis.Redis, case: str
) -> None:
    # BREAK (issue 23, 1): `"deadline": Infinity` made Router._ttl raise OverflowError,
    # the worker died, and so did every worker that reclaimed the entry.
    reply_to = harness.keys.reply_stream(f"poison-{case.replace(' ', '-')}")
    stream = harness.keys.stage_stream(STAGE.name)
    await redis.xadd(stream, _forge("forged", reply_to, case))  # type: ignore[arg-type]
    worker = harness.worker(STAGE, Doubler())
    await worker.start()
    running = harness.run(worker)

    async def answered() -> bool:
        return await _reply(redis, reply_to, "forged") is not None

    await until(answered, 30)
    reply = await _reply(redis, reply_to, "forged")
    assert (reply.outcome, reply.status) == ("error", 500), reply
    assert "dead-lettered" in (reply.error or "")
    assert await redis.xlen(harness.keys.dead_letters(STAGE.name)) == 1
    await _served(harness, redis, reply_to)
    assert not running.done(), running


@pytest.mark.timeout(60)
async def test_a_forged_entry_past_the_delivery_cap_is_dead_lettered_on_reclaim(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # BREAK (issue 23, 1): the dead-letter path ran the same failing code, so a poison
    # entry over the delivery cap was never dead-lettered: every worker that reclaimed it
    # died ~10 s after starting, and its delivery count climbed.
    reply_to = harness.keys.reply_stream("poison-reclaimed")
    stream = harness.keys.stage_stream(STAGE.name)
    await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    eid = await redis.xadd(stream, _forge("reclaimed", reply_to, "infinite deadline"))  # type: ignore[arg-type]
    # Delivered to workers that died with it, over and over (each claim counts).
    await redis.xreadgroup(GROUP, "died-1", {stream: ">"})
    for n in range(2, 5):
        await redis.xclaim(stream, GROUP, f"died-{n}", 0, [eid])
    fast: dict[str, Any] = {"max_deliveries": 3, "min_idle_ms": 10, "reclaim_interval_ms": 10}
    worker = harness.worker(STAGE, Doubler(), **fast)
    await worker.start()
    running = harness.run(worker)

    async def answered() -> bool:
        return await _reply(redis, reply_to, "reclaimed") is not None

    await until(answered, 30)
    reply = await _reply(redis, reply_to, "reclaimed")
    assert (reply.outcome, reply.status) == ("error", 500), reply
    assert "dead-lettered" in (reply.error or "")
    assert await redis.xlen(harness.keys.dead_letters(STAGE.name)) == 1
    assert (await redis.xpending(stream, GROUP))["pending"] == 0
    await _served(harness, redis, reply_to)
    assert not running.done(), running


@pytest.mark.timeout(60)
async def test_a_forged_cost_field_is_ignored_by_length_aware_batching(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # BREAK (issue 23, 1): a `c` field of 5,000 digits passed bytes.isdigit, and int()
    # refused it (Python's 4,300-digit limit) inside the batch window: the worker died.
    stage = number_stage("poison-cost", max_batch_tokens=4096)
    reply_to = harness.keys.reply_stream("poison-cost")
    fields = _forge("costly", reply_to, "huge attempt")
    body = orjson.loads(fields[FIELD]) | {"attempt": 0, "stage": stage.name}
    body |= {"pipeline": stage.name, "step": stage.name}
    stream = harness.keys.stage_stream(stage.name)
    # With another entry, so the window's entries are split by length (one is not).
    await redis.xadd(stream, {FIELD: orjson.dumps(body), COST: b"9" * 5000})
    await redis.xadd(stream, {FIELD: orjson.dumps(body | {"id": "cheap"}), COST: b"4"})
    worker = harness.worker(stage, Doubler())
    await worker.start()
    running = harness.run(worker)

    async def answered() -> bool:
        return all([await _reply(redis, reply_to, rid) for rid in ("costly", "cheap")])

    await until(answered, 30)
    for rid in ("costly", "cheap"):
        reply = await _reply(redis, reply_to, rid)
        assert (reply.outcome, reply.result) == ("ok", {"value": 2}), reply
    assert not running.done(), running
