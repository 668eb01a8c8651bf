"""The publish script: what a repeated call, or a step run twice, adds (on a real Redis)."""

from __future__ import annotations

from typing import Any, cast

import redis.asyncio as aioredis

from pipelines.envelope import Reply, decode_replies
from pipelines.keys import GROUP, Keys
from pipelines.outcomes import DONE, EXPIRED, FAILED, Outcome
from pipelines.records import JobRecord
from runtime.redisio import ensure_group
from tests.helpers import Harness, replies_in
from workers.plan import Call
from workers.publish import publish
from workers.values import Effects, Outbox, Published


def outbox(
    keys: Keys, ids: list[str], outcome: str = "ok", *, cancels: bool = False, batched: bool = True
) -> Outbox:
    """One answered request per id, each under its done marker (and, with ``cancels``,
    its cancellation marker), to a gateway that reads several replies an entry unless
    ``batched`` is False (one of an earlier release)."""
    out = Outbox()
    for rid in ids:
        if outcome == "ok":
            reply = Reply(id=rid, stage="s", outcome=Outcome.OK, result={"v": 1})
        else:
            reply = Reply(id=rid, stage="s", outcome=Outcome.ERROR, error="boom", status=500)
        to = keys.reply_stream("t")
        effects = Effects(marker_ttl_s=60, replies=[(to, reply)], batched=batched)
        if cancels:
            effects.cancel_marker = keys.cancelled(rid)
        out.effects[keys.done(rid, "s")] = effects
    return out


async def entries_of(redis: aioredis.Redis, stream: str) -> list[dict[bytes, bytes]]:
    """The fields of every entry of ``stream``, in order."""
    return [fields for _, fields in cast(list[Any], await redis.xrange(stream))]


async def read_batch(redis: aioredis.Redis, stream: str, n: int) -> list[bytes]:
    """``n`` entries added to ``stream`` and read by consumer c1: their ids."""
    await ensure_group(redis, stream)
    pipe = redis.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(stream, {"e": str(i)})
    await pipe.execute()
    read: Any = await redis.xreadgroup(GROUP, "c1", {stream: ">"})
    return [eid for eid, _ in read[0][1]]


async def publish_batch(
    redis: aioredis.Redis,
    keys: Keys,
    out: Outbox,
    ids: list[bytes],
    token: str,
    model_items: int,
    **extra: Any,
) -> Published:
    """Publish ``out`` as one batch of stage ``s`` over the entries ``ids`` (acked), the
    model having run ``model_items``; ``extra``: more of publish()'s arguments."""
    call = Call(
        out,
        acks={keys.stage_stream("s"): ids},
        stats_key=keys.stage_stats("s"),
        stats={"batches": 1, "model_items": model_items},
        reply_ttl_s=60,
        token_key=keys.publish_token(token),
        **{"reply_maxlen": 100, **extra},
    )
    return await publish(redis, call)


async def test_a_repeated_call_is_a_complete_no_op(harness: Harness, redis: aioredis.Redis) -> None:
    # A call Redis ran but whose answer was lost is retried: nothing may happen twice,
    # not even what no done marker guards (batch stats, dead letters).
    keys = harness.keys
    ids = await read_batch(redis, keys.stage_stream("s"), 3)
    out = outbox(harness.keys, ["a", "b"])
    for again in (False, True):
        published = await publish_batch(
            redis,
            keys,
            out,
            ids,
            "once",
            2,
            dead_letters=[(keys.dead_letters("s"), {"why": "test"})],
            dropped=[keys.dropped("s", ids[2].decode())],
            again=again,
        )
        assert published == Published()  # the repeat answers what the first call answered
    assert await replies_in(redis, keys.reply_stream("t")) == 2
    assert await redis.xlen(keys.dead_letters("s")) == 1
    got = await harness.stats("s")
    counted = ("batches", "model_items", "items:ok", "items:error")
    assert {k: got[k] for k in counted} == dict(zip(counted, (1, 2, 2, 1), strict=True))
    assert 0 < await redis.ttl(keys.publish_token("once")) <= 300


async def test_outcomes_are_counted_once_per_request_answered(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Two workers ran the same entries (one stalled, the other reclaimed them): each
    # request is answered and counted once; the work itself is counted twice.
    keys = harness.keys
    ids = await read_batch(redis, keys.stage_stream("s"), 3)
    for worker in ("first", "second"):
        out = outbox(harness.keys, ["a", "b"])
        out.effects.update(outbox(harness.keys, ["c"], outcome=Outcome.ERROR).effects)
        await publish_batch(redis, keys, out, ids, worker, 3)
    got = await harness.stats("s")
    assert (got["items:ok"], got["items:error"]) == (2, 1)  # 4 and 2 before
    assert (got["batches"], got["model_items"]) == (2, 6)
    assert await replies_in(redis, keys.reply_stream("t")) == 3


async def test_a_jobs_reply_finishes_its_record(harness: Harness, redis: aioredis.Redis) -> None:
    # A reply addressed to a job is stored in its record (kept job_ttl_s), not streamed,
    # with the status the synchronous call would have answered.
    keys = harness.keys
    ids = await read_batch(redis, keys.stage_stream("s"), 3)
    replies = {
        "ok": Reply(id="ok", stage="s", outcome=Outcome.OK, result={"v": 1}),
        "failed": Reply(id="failed", stage="s", outcome=Outcome.ERROR, error="boom", status=422),
        "expired": Reply(
            id="expired", stage="s", outcome=Outcome.EXPIRED, error="late", status=504
        ),
    }
    out = Outbox()
    for rid, reply in replies.items():
        effects = Effects(marker_ttl_s=60, replies=[(keys.job(rid), reply)])
        out.effects[keys.done(rid, "s")] = effects
    await publish_batch(redis, keys, out, ids, "jobs", 3, job_prefix=keys.job_prefix, job_ttl_s=90)
    records = {rid: JobRecord.parse(await redis.hgetall(keys.job(rid))) for rid in replies}
    assert records["ok"] == JobRecord(status=DONE, result='{"v":1}', http_status=200)
    assert records["failed"] == JobRecord(status=FAILED, error="boom", http_status=422)
    assert records["expired"] == JobRecord(status=EXPIRED, error="late", http_status=504)
    assert 0 < await redis.ttl(keys.job("ok")) <= 90
    assert await redis.exists(keys.reply_stream("t")) == 0


async def test_a_call_that_would_meet_a_key_of_another_type_writes_nothing(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Issue 28, break 5: a reply key SET to a string failed the script with WRONGTYPE
    # midway, and what it had written before the error stayed (replies, markers, counts).
    # Now the script checks every key first: it writes nothing at all and names the
    # request whose effects would fail, with the key and what it holds.
    keys = harness.keys
    ids = await read_batch(redis, keys.stage_stream("s"), 4)
    out = outbox(harness.keys, ["a", "b"])
    bad = keys.reply_stream("forged")
    await redis.set(bad, "not a stream")
    culprit = Reply(id="c", stage="s", outcome=Outcome.OK, result={"v": 1})
    out.effects[keys.done("c", "s")] = Effects(marker_ttl_s=60, replies=[(bad, culprit)])
    out.effects.update(outbox(harness.keys, ["d"]).effects)
    published = await publish_batch(
        redis,
        keys,
        out,
        ids,
        "refused",
        4,
        dead_letters=[(keys.dead_letters("s"), {"why": "test"})],
        dropped=[keys.dropped("s", ids[3].decode())],
        gauges={"cost_a": 1.0},
    )
    assert published.refused == {keys.done("c", "s"): (bad, "string")}
    assert await redis.get(bad) == b"not a stream"
    written = [key async for key in redis.scan_iter(match=f"{keys.prefix}:*")]
    assert sorted(written) == sorted([bad.encode(), keys.stage_stream("s").encode()])
    pending = await redis.xpending(keys.stage_stream("s"), GROUP)
    assert pending["pending"] == 4  # nothing acked


async def test_own_keys_of_another_type_are_skipped_and_the_batch_answered(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # The stats hash and the dead-letter stream are written by every call, whatever its
    # requests: one SET to a string is no request's fault. What the call would write
    # there is skipped and named; the replies, markers and acks are written.
    keys = harness.keys
    ids = await read_batch(redis, keys.stage_stream("s"), 2)
    await redis.set(keys.stage_stats("s"), "x")
    await redis.set(keys.dead_letters("s"), "x")
    published = await publish_batch(
        redis,
        keys,
        outbox(harness.keys, ["a", "b"]),
        ids,
        "own",
        2,
        dead_letters=[(keys.dead_letters("s"), {"why": "test"})],
    )
    assert published.broken == {keys.stage_stats("s"), keys.dead_letters("s")}
    assert not published.refused
    assert await replies_in(redis, keys.reply_stream("t")) == 2
    assert await redis.exists(keys.done("a", "s"), keys.done("b", "s")) == 2
    assert (await redis.xpending(keys.stage_stream("s"), GROUP))["pending"] == 0
    assert await redis.get(keys.stage_stats("s")) == b"x"


async def test_a_batch_s_replies_to_one_gateway_are_one_entry_in_order(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Issue 37: a reply was one XADD each (~4 µs of Redis's time per request inside the
    # script); a batch's replies to one stream are now one entry, e then e1, e2, ... in
    # the batch's order. A request with more to write than its reply (here a second
    # reply, to another stream) still writes its reply first, in an entry of its own.
    keys = harness.keys
    ids = await read_batch(redis, keys.stage_stream("s"), 7)
    out = outbox(harness.keys, ["a", "b", "c", "d", "e"])
    other = keys.reply_stream("u")
    for rid in ("f", "g"):
        reply = Reply(id=rid, stage="s", outcome=Outcome.OK, result={"v": 2})
        effects = Effects(marker_ttl_s=60, replies=[(other, reply)], batched=True)
        if rid == "g":
            again = Reply(id="g", stage="s", outcome=Outcome.OK, result={"v": 3})
            effects.replies.append((other, again))
        out.effects[keys.done(rid, "s")] = effects
    assert await publish_batch(redis, keys, out, ids, "one", 7) == Published()
    [fields] = await entries_of(redis, keys.reply_stream("t"))
    assert list(fields) == [b"e", b"e1", b"e2", b"e3", b"e4"]
    assert [r.id for r in decode_replies(fields)] == ["a", "b", "c", "d", "e"]
    # g's two replies, each its own entry (written with its commands), then f's.
    got = [[(r.id, r.result) for r in decode_replies(f)] for f in await entries_of(redis, other)]
    assert got == [[("g", {"v": 2})], [("g", {"v": 3})], [("f", {"v": 2})]]
    assert (await harness.stats("s"))["items:ok"] == 7
    assert (await redis.xpending(keys.stage_stream("s"), GROUP))["pending"] == 0


async def test_a_run_of_requests_meeting_a_key_of_another_type_is_refused_whole(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Alike requests in a row reach the script as one run (workers/plan.py): a run whose
    # reply stream holds a string names every request of it, and writes nothing; a run
    # whose markers exist (published before) is skipped whole, and the others answered.
    keys = harness.keys
    ids = await read_batch(redis, keys.stage_stream("s"), 7)
    bad = keys.reply_stream("forged")
    await redis.set(bad, "not a stream")
    out = outbox(harness.keys, ["a", "b", "c"])
    for rid in ("x", "y", "z"):
        reply = Reply(id=rid, stage="s", outcome=Outcome.OK, result={"v": 1})
        effects = Effects(marker_ttl_s=60, replies=[(bad, reply)], batched=True)
        out.effects[keys.done(rid, "s")] = effects
    published = await publish_batch(redis, keys, out, ids[:6], "refused", 6)
    assert published.refused == {keys.done(r, "s"): (bad, "string") for r in "xyz"}
    assert not await redis.exists(keys.reply_stream("t"), keys.done("a", "s"))
    # Published once, then again with three more: the first three are skipped.
    assert (
        await publish_batch(redis, keys, outbox(harness.keys, ["a", "b", "c"]), ids[:3], "p1", 3)
        == Published()
    )
    again = outbox(harness.keys, ["a", "b", "c", "d"])
    assert await publish_batch(redis, keys, again, ids[3:], "p2", 4) == Published(skipped=3)
    got = [r.id for f in await entries_of(redis, keys.reply_stream("t")) for r in decode_replies(f)]
    assert got == ["a", "b", "c", "d"]
