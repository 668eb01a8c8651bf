"""The publish plan's shape (pure: no Redis): what ``publish.lua`` is handed per batch.

The script's own work (decoding and walking the plan) was most of a batch's Redis time
while the plan was nested; these pin the flat shape it reads, so a change that nests it
again, or passes what it reads out of order, is seen here and not only in a benchmark.
"""

from __future__ import annotations

from typing import Any, cast

import orjson

from pipelines.envelope import FIELD, REPLIES_PER_ENTRY, Reply, dumps
from pipelines.keys import GROUP, Keys
from pipelines.outcomes import Outcome
from workers.plan import Call, Plan, compile_plan
from workers.values import Effects, JoinArrival, Outbox

KEYS = Keys("t")
STAGE = KEYS.stage_stream("s")
REPLIES = KEYS.reply_stream("g")


def _call(out: Outbox, ids: list[bytes], **extra: Any) -> Call:
    return Call(
        out,
        acks={STAGE: ids},
        stats_key=KEYS.stage_stats("s"),
        stats={},
        reply_maxlen=100,
        reply_ttl_s=60,
        token_key=KEYS.publish_token("x"),
        unmark={KEYS.on_model(STAGE): ids},
        **extra,
    )


def _plan(call: Call) -> tuple[Plan, dict[str, Any]]:
    plan = compile_plan(call)
    assert plan is not None
    encoded = plan.script_args()[0]
    assert isinstance(encoded, bytes)
    return plan, orjson.loads(encoded)


def _commands(tokens: list[Any], i: int = 0) -> list[list[Any]]:
    """The commands of a flat token list from ``i``: each is its length, then itself."""
    out = []
    while i < len(tokens):
        out.append(tokens[i + 1 : i + 1 + tokens[i]])
        i += 1 + tokens[i]
    return out


def _unrolled(run: list[Any]) -> list[list[Any]]:
    """The groups a run stands for, as ``publish.lua`` unrolls it."""
    _, n, marker, dm, ttl, cancel, dc, counted, stream, reply, dr = run
    return [
        [marker + i * dm, ttl, cancel + i * dc, counted, stream, reply + i * dr] for i in range(n)
    ]


def _reply(rid: str) -> Reply:
    return Reply(id=rid, stage="s", outcome=Outcome.OK, result={"v": rid})


def test_a_batch_of_replies_is_one_flat_group_each_and_reads_come_first() -> None:
    out = Outbox()
    for rid in ("a", "b", "c"):
        out.effects[KEYS.done(rid, "s")] = Effects(
            marker_ttl_s=60, replies=[(REPLIES, _reply(rid))], cancel_marker=KEYS.cancelled(rid)
        )
    ids = [b"1-0", b"1-1", b"1-2"]
    plan, decoded = _plan(_call(out, ids))
    # The markers read (done and cancelled, each request's) are KEYS[1..m], in one MGET.
    assert decoded["m"] == 6
    reads = {KEYS.done(r, "s") for r in "abc"} | {KEYS.cancelled(r) for r in "abc"}
    assert set(plan.keys[:6]) == reads
    stream = -(plan.keys.index(REPLIES) + 1)
    # Alike, in a row: one run of three, which the script unrolls.
    [run] = decoded["g"]
    assert run[:2] == ["R", 3]
    for rid, group in zip("abc", _unrolled(run), strict=True):
        marker, ttl, cancel, counted, to, value = group  # no command beyond the reply
        assert plan.keys[-marker - 1] == KEYS.done(rid, "s")
        assert plan.keys[-cancel - 1] == KEYS.cancelled(rid)
        assert (ttl, counted, to) == ("60", "items:ok", stream)
        assert plan.values[value - 1] == dumps(_reply(rid))
    assert decoded["f"] == FIELD.decode()
    assert decoded["n"] == REPLIES_PER_ENTRY  # replies an entry: what a gateway reads of one
    assert plan.keys[decoded["h"] - 1] == KEYS.stage_stats("s")
    # Each entry id is passed once, for its ack and for its on-model mark alike.
    assert sorted(v for v in plan.values if isinstance(v, bytes) and v in ids) == ids
    expire, xack, hdel = _commands(decoded["a"])  # the reply stream's life pushed back once
    assert expire == ["EXPIRE", stream, "60"]
    assert xack[:3] == ["XACK", -(plan.keys.index(STAGE) + 1), GROUP]
    # The ids, numbered in a row, are one span [first, last]; the marks' HDEL shares it.
    [[first, last]] = xack[3:]
    assert sorted(cast(list[bytes], plan.values[first - 1 : last])) == ids
    assert hdel[2:] == xack[3:]
    assert not plan.token  # nothing counted by the call itself: safe to repeat as it is


def test_a_failed_branch_answers_under_its_join_marker_and_a_job_s_reply_is_a_command() -> None:
    out = Outbox()
    failed = Reply(id="a", stage="s", outcome=Outcome.ERROR, error="no", status=422)
    join = KEYS.join("a", "j")
    out.effects[KEYS.done("a", "s")] = Effects(
        marker_ttl_s=60,
        replies=[(REPLIES, failed)],
        failed_joins=[(join, 30)],
        answer_marker=KEYS.done("a", "j"),
    )
    arrival = JoinArrival(join, STAGE, "left", b"{}", 2, b"{}", 30)
    out.effects[KEYS.done("b", "s")] = Effects(
        marker_ttl_s=60, replies=[(KEYS.job("b"), _reply("b"))], joins=[arrival]
    )
    plan, decoded = _plan(_call(out, [b"1-0", b"1-1"], job_prefix=KEYS.job_prefix))
    first, second = decoded["g"]
    # The failed branch: no reply in the slot (it is guarded), ONCE over the span of its
    # reply and its failed join, counted as an error.
    assert first[3:6] == ["items:error", 0, 0]
    once = first[6:11]
    assert once[:2] == [4, "ONCE"]
    assert plan.keys[-once[2] - 1] == KEYS.done("a", "j")
    guarded = first[11:]
    assert len(guarded) == once[4]
    assert [c[0] for c in _commands(guarded)] == ["XADD", "FAILJOIN"]
    # A job's reply is stored in its hash (HSET, EXPIRE), then the branch's JOIN.
    assert second[4:6] == [0, 0]
    assert [c[0] for c in _commands(second, 6)] == ["HSET", "EXPIRE", "JOIN"]
