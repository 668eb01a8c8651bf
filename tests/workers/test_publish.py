"""The publish script: what a repeated call, or a step run twice, adds (on a real Redis)."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from pipelines.envelope import Reply
from pipelines.keys import GROUP
from pipelines.redisio import ensure_group
from tests.helpers import Harness
from workers.publish import publish
from workers.route import Effects, Outbox


def outbox(harness: Harness, ids: list[str], outcome: str = "ok") -> Outbox:
    """One answered request per id, each under its done marker."""
    out = Outbox()
    for rid in ids:
        reply = Reply(id=rid, stage="s", outcome="ok", result={"v": 1}) if outcome == "ok" else (
            Reply(id=rid, stage="s", outcome="error", error="boom", status=500))  # fmt: skip
        effects = Effects(marker_ttl_s=60, replies=[(harness.keys.reply_stream("t"), reply)])
        out.effects[harness.keys.done(rid, "s")] = effects
    return out


async def read_batch(redis: aioredis.Redis, stream: str, n: int) -> list[bytes]:
    await ensure_group(redis, stream)
    for i in range(n):
        await redis.xadd(stream, {"e": str(i)})
    read: Any = await redis.xreadgroup(GROUP, "c1", {stream: ">"})
    return [eid for eid, _ in read[0][1]]


async def test_a_repeated_call_is_a_complete_no_op(harness: Harness, redis: aioredis.Redis) -> None:
    # A call Redis ran but whose answer was lost is retried: nothing may happen twice,
    # not even what no done marker guards (batch stats, dead letters).
    keys = harness.keys
    stream, stats = keys.stage_stream("s"), keys.stage_stats("s")
    ids = await read_batch(redis, stream, 3)
    token = keys.publish_token("once")
    out = outbox(harness, ["a", "b"])
    for _ in range(2):
        skipped = await publish(
            redis, out, stream=stream, entry_ids=ids, stats_key=stats,
            stats={"batches": 1, "model_items": 2}, reply_maxlen=100, reply_ttl_s=60,
            token_key=token, dead_letters=[(keys.dead_letters("s"), {"why": "test"})],
            dropped=[keys.dropped("s", ids[2].decode())],
        )  # fmt: skip
        assert skipped == 0  # the repeat answers what the first call answered
    assert await redis.xlen(keys.reply_stream("t")) == 2
    assert await redis.xlen(keys.dead_letters("s")) == 1
    got = await harness.stats("s")
    assert {k: got[k] for k in ("batches", "model_items", "items:ok", "items:error")} == {
        "batches": 1, "model_items": 2, "items:ok": 2, "items:error": 1}  # fmt: skip
    assert 0 < await redis.ttl(token) <= 300


async def test_outcomes_are_counted_once_per_request_answered(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Two workers ran the same entries (one stalled, the other reclaimed them): each
    # request is answered and counted once; the work itself is counted twice.
    keys = harness.keys
    stream, stats = keys.stage_stream("s"), keys.stage_stats("s")
    ids = await read_batch(redis, stream, 3)
    for worker in ("first", "second"):
        out = outbox(harness, ["a", "b"])
        out.effects.update(outbox(harness, ["c"], outcome="error").effects)
        await publish(
            redis, out, stream=stream, entry_ids=ids, stats_key=stats,
            stats={"batches": 1, "model_items": 3}, reply_maxlen=100, reply_ttl_s=60,
            token_key=keys.publish_token(worker),
        )  # fmt: skip
    got = await harness.stats("s")
    assert (got["items:ok"], got["items:error"]) == (2, 1)  # 4 and 2 before
    assert (got["batches"], got["model_items"]) == (2, 6)
    assert await redis.xlen(keys.reply_stream("t")) == 3
