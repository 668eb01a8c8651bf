"""Review of a batch's replies as one entry and of runs of alike groups (workers/publish.lua,
workers/plan.py), on a real Redis: cancelled, skipped and dropped requests inside a run,
the reply cap, big batches."""

from __future__ import annotations

import asyncio
from typing import Any, Literal, cast

import orjson
import pytest
import redis.asyncio as aioredis

from gateway.replies import ReplyDispatcher
from pipelines.envelope import Reply, decode_replies, encode
from pipelines.keys import GROUP, Keys
from pipelines.outcomes import Outcome
from tests.helpers import Harness, replies_in
from tests.workers.test_publish import entries_of, outbox, read_batch
from workers.plan import Call, compile_plan
from workers.publish import publish
from workers.values import Effects, Outbox, Published


def call_of(keys: Keys, out: Outbox, ids: list[bytes], token: str, **extra: Any) -> Call:
    return Call(
        out,
        acks={keys.stage_stream("s"): ids},
        stats_key=keys.stage_stats("s"),
        stats={"batches": 1},
        reply_ttl_s=60,
        token_key=keys.publish_token(token),
        **{"reply_maxlen": 100_000, **extra},
    )


async def got_ids(redis: aioredis.Redis, stream: str) -> list[list[str]]:
    """The request ids each entry of ``stream`` answers, entry by entry."""
    return [[r.id for r in decode_replies(f)] for f in await entries_of(redis, stream)]


def is_one_run(call: Call) -> bool:
    plan = compile_plan(call)
    assert plan is not None
    groups = orjson.loads(cast(bytes, plan.script_args()[0]))["g"]
    return [g[0] for g in groups] == ["R"]


async def test_cancelled_and_skipped_requests_inside_a_run(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Seven alike requests (one run): b and e cancelled while they ran, d published
    # before. The others' replies are one entry, named e, e1, e2, ... without gaps.
    keys = harness.keys
    rids = list("abcdefg")
    ids = await read_batch(redis, keys.stage_stream("s"), len(rids))
    await redis.set(keys.cancelled("b"), "1")
    await redis.set(keys.cancelled("e"), "1")
    await redis.set(keys.done("d", "s"), "1")
    call = call_of(keys, outbox(keys, rids, cancels=True), ids, "cs")
    assert is_one_run(call)
    published = await publish(redis, call)
    assert published == Published(
        skipped=1, cancelled=frozenset({keys.done("b", "s"), keys.done("e", "s")})
    )
    [fields] = await entries_of(redis, keys.reply_stream("t"))
    assert list(fields) == [b"e", b"e1", b"e2", b"e3"]
    assert [r.id for r in decode_replies(fields)] == ["a", "c", "f", "g"]
    stats = await harness.stats("s")
    assert (stats["items:ok"], stats["items:cancelled"]) == (4, 2)
    assert await redis.exists(*(keys.done(r, "s") for r in rids)) == 7
    assert (await redis.xpending(keys.stage_stream("s"), GROUP))["pending"] == 0


async def test_dropped_entries_in_a_run_count_once_and_write_no_reply(
    harness: Harness, redis: aioredis.Redis
) -> None:
    keys = harness.keys
    ids = await read_batch(redis, keys.stage_stream("s"), 7)
    dropped = [keys.dropped("s", f"1-{i}") for i in range(4)]
    call = call_of(keys, outbox(keys, ["a", "b", "c"]), ids, "d1", dropped=dropped)
    assert await publish(redis, call) == Published()
    again = call_of(keys, outbox(keys, ["a", "b", "c"]), ids, "d2", dropped=dropped)
    assert await publish(redis, again) == Published(skipped=7)
    assert await got_ids(redis, keys.reply_stream("t")) == [["a", "b", "c"]]
    stats = await harness.stats("s")
    assert (stats["items:ok"], stats["items:error"]) == (3, 4)
    assert await redis.exists(*dropped) == 4


async def test_a_retried_call_writes_its_batched_entry_once(
    harness: Harness, redis: aioredis.Redis
) -> None:
    keys = harness.keys
    ids = await read_batch(redis, keys.stage_stream("s"), 5)
    for again in (False, True):
        call = call_of(keys, outbox(keys, list("abcde")), ids, "rt", again=again)
        assert await publish(redis, call) == Published()
    assert await got_ids(redis, keys.reply_stream("t")) == [list("abcde")]
    assert (await harness.stats("s"))["batches"] == 1


async def test_a_large_batch_with_runs_and_plain_groups(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # 2,600 requests: runs broken every 7th by a request with a second reply (a plain
    # group, its entry written first), cut at 500 per entry; the cap stays an integer
    # (a cap high enough that nothing is trimmed).
    keys = harness.keys
    rids = [f"r{i}" for i in range(2600)]
    ids = await read_batch(redis, keys.stage_stream("s"), len(rids))
    out = outbox(keys, rids)
    other = keys.reply_stream("u")
    plain = rids[::7]
    for rid in plain:
        extra = Reply(id=rid, stage="s", outcome=Outcome.OK, result={"v": 2})
        out.effects[keys.done(rid, "s")].replies.append((other, extra))
    call = call_of(keys, out, ids, "big", reply_maxlen=10**7)
    assert await publish(redis, call) == Published()
    got = await got_ids(redis, keys.reply_stream("t"))
    batched = [r for r in rids if r not in set(plain)]
    assert [len(e) for e in got] == [1] * len(plain) + [500] * 4 + [len(batched) - 2000]
    assert [r for e in got for r in e] == plain + batched
    assert [r for e in await got_ids(redis, other) for r in e] == plain
    assert (await harness.stats("s"))["items:ok"] == 2600
    assert (await redis.xpending(keys.stage_stream("s"), GROUP))["pending"] == 0


@pytest.mark.parametrize(("unread", "batch", "maxlen"), [(800, 100, 1000), (400, 500, 100_000)])
async def test_a_batch_s_cap_keeps_the_unread_replies_of_smaller_entries(
    harness: Harness, redis: aioredis.Redis, unread: int, batch: int, maxlen: int
) -> None:
    # The cap counts replies (docs/configuration.md: "approximate cap on the replies each
    # reply stream holds"): a stream holding far fewer replies than reply_maxlen loses
    # none. ``unread`` single-reply entries (a streaming stage's partials, or one-request
    # batches of other workers) that the gateway has not read yet, then one batch of
    # ``batch`` replies, under a cap of ``maxlen`` (the second case: the default).
    # Observed: the batch's entry is written under MAXLEN ~ ceil(maxlen / batch) entries,
    # which trims the unread single-reply entries (whole radix nodes of 100).
    keys = harness.keys
    stream = keys.reply_stream("t")
    pipe = redis.pipeline(transaction=False)
    for i in range(unread):
        partial = Reply(id=f"p{i}", stage="s", outcome="partial", result={"text": "x"})
        pipe.xadd(stream, encode(partial), maxlen=maxlen, approximate=True)
    await pipe.execute()
    ids = await read_batch(redis, keys.stage_stream("s"), batch)
    out = outbox(keys, [f"r{i}" for i in range(batch)])
    assert await publish(redis, call_of(keys, out, ids, "cap", reply_maxlen=maxlen)) == Published()
    assert await replies_in(redis, stream) == unread + batch


async def test_the_gateway_answers_each_reply_of_an_entry_alone(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # A forged entry: a valid reply (a), one that does not validate but names its id (b:
    # answered 502), one unreadable (skipped), then a partial and the final reply of a
    # streaming request (s1, in that order); fields past a gap (e6 without e5) and odd
    # names (e01, e-1) are not replies.
    keys = harness.keys
    stream = keys.reply_stream("g")

    def reply(rid: str, outcome: Outcome | Literal["partial"] = Outcome.OK) -> bytes:
        raw = encode(Reply(id=rid, stage="s", outcome=outcome, result={"v": rid}))
        return cast(bytes, raw[b"e"])

    fields = {
        b"e": reply("a"),
        b"e1": b'{"id": "b", "stage": "s", "outcome": "no such outcome"}',
        b"e2": b"{not json",
        b"e3": reply("s1", "partial"),
        b"e4": reply("s1"),
        b"e6": reply("c"),
        b"e01": reply("c"),
        b"e-1": reply("c"),
    }
    await redis.xadd(stream, cast(Any, fields))
    dispatcher = ReplyDispatcher(redis, [stream], block_ms=100)
    a, b, c = dispatcher.expect("a"), dispatcher.expect("b"), dispatcher.expect("c")
    queue = dispatcher.expect_stream("s1")
    reading = asyncio.ensure_future(dispatcher.run())
    try:
        got_a, got_b = await asyncio.wait_for(asyncio.gather(a, b), 10)
        assert (got_a.outcome, got_a.result) == (Outcome.OK, {"v": "a"})
        assert (got_b.outcome, got_b.status) == (Outcome.ERROR, 502)
        first, last = (
            await asyncio.wait_for(queue.get(), 10),
            await asyncio.wait_for(queue.get(), 10),
        )
        assert (first.outcome, last.outcome) == ("partial", Outcome.OK)
        assert not c.done()
    finally:
        dispatcher.stop()
        await asyncio.wait_for(reading, 10)


async def test_runs_around_a_job_and_two_failed_branches_of_one_join(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # a, b, c (a run), a job's reply (a command: its hash), then two failed branches of
    # one join (each guarded by the join's answer marker: one answer between them), then
    # d, e, f (a run). Stream t gets the branches' one answer (written with its
    # commands, first), then the six others' replies in one entry; the job's hash its
    # result.
    keys = harness.keys
    stream = keys.reply_stream("t")
    ids = await read_batch(redis, keys.stage_stream("s"), 9)
    out = outbox(keys, ["a", "b", "c"])
    job = keys.job("j1")
    done = Reply(id="j1", stage="s", outcome=Outcome.OK, result={"v": 9})
    out.effects[keys.done("j1", "s")] = Effects(marker_ttl_s=60, replies=[(job, done)])
    for branch in ("x1", "x2"):
        failed = Reply(id="x", stage="s", outcome=Outcome.ERROR, error=branch, status=422)
        out.effects[keys.done(branch, "s")] = Effects(
            marker_ttl_s=60,
            replies=[(stream, failed)],
            failed_joins=[(keys.join("x", "j"), 30)],
            answer_marker=keys.done("x", "j"),
        )
    out.effects.update(outbox(keys, ["d", "e", "f"]).effects)
    call = call_of(keys, out, ids, "mix", job_prefix=keys.job_prefix)
    assert await publish(redis, call) == Published()
    entries = cast(list[Any], await redis.xrange(stream))
    got = [[(r.id, r.error) for r in decode_replies(f)] for _, f in entries]
    assert got == [[("x", "x1")], [(r, None) for r in "abcdef"]]
    assert (await redis.hgetall(job))[b"status"] == b"done"
    assert await redis.hget(keys.join("x", "j"), "!failed") == b"1"
    stats = await harness.stats("s")
    assert (stats["items:ok"], stats["items:error"]) == (7, 2)


async def test_a_plain_group_between_runs_refused_alone_and_nothing_written(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # a, b, c (a run, one of them published before), then m handing on to a stream that
    # holds a string, then d, e, f (a run): only m is refused, and the call writes
    # nothing (no marker, no reply, no ack).
    keys = harness.keys
    ids = await read_batch(redis, keys.stage_stream("s"), 7)
    await redis.set(keys.done("b", "s"), "1")
    bad = keys.stage_stream("next")
    await redis.set(bad, "not a stream")
    out = outbox(keys, ["a", "b", "c"])
    handed = harness.request("p", "next", "next", {"value": 1})
    out.effects[keys.done("m", "s")] = Effects(marker_ttl_s=60, forwards=[(bad, handed)])
    out.effects.update(outbox(keys, ["d", "e", "f"]).effects)
    published = await publish(redis, call_of(keys, out, ids, "ref"))
    assert published.refused == {keys.done("m", "s"): (bad, "string")}
    assert not await redis.exists(keys.reply_stream("t"), keys.done("a", "s"), keys.done("f", "s"))
    assert (await redis.xpending(keys.stage_stream("s"), GROUP))["pending"] == 7


async def test_a_gateway_of_the_previous_release_reads_every_reply_of_a_batch(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # docs/how-it-works.md: "during a rolling deploy an older worker runs a newer
    # gateway's requests ... in either order". A gateway of the release before 97f0709
    # reads a reply entry as Reply.model_validate_json(fields[b"e"]): the replies in e1,
    # e2, ... of a newer worker's entry were neither read nor refused (found in review:
    # their callers waited out their deadlines). Its requests do not say reply_batches, so
    # each of their replies is an entry of its own; a newer gateway's, beside them in the
    # same batch, still share one.
    keys = harness.keys
    ids = await read_batch(redis, keys.stage_stream("s"), 5)
    out = outbox(keys, ["a", "b", "c"], batched=False)
    newer = outbox(keys, ["d", "e"])
    for effects in newer.effects.values():
        effects.replies = [(keys.reply_stream("n"), r) for _, r in effects.replies]
    out.effects.update(newer.effects)
    assert await publish(redis, call_of(keys, out, ids, "old")) == Published()
    entries = cast(list[Any], await redis.xrange(keys.reply_stream("t")))
    old_reader = [Reply.model_validate_json(fields[b"e"]).id for _, fields in entries]
    assert old_reader == ["a", "b", "c"]
    assert await got_ids(redis, keys.reply_stream("n")) == [["d", "e"]]
    # One request of an older gateway among a stream's replies: none of them share.
    ids = await read_batch(redis, keys.stage_stream("s"), 3)
    mixed = outbox(keys, ["f", "g"])
    mixed.effects.update(outbox(keys, ["h"], batched=False).effects)
    assert await publish(redis, call_of(keys, mixed, ids, "mixed")) == Published()
    assert (await got_ids(redis, keys.reply_stream("t")))[3:] == [["f"], ["g"], ["h"]]
