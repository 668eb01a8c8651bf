"""Adversarial tests of the reply path (issue 23, breaks 3 and 5): what a gateway reads
back from Redis. Each FAILS on the code it was written against; the comment on each
states the break, what was observed against what is promised, and the trigger. Every
test is bounded in time and uses a real redis-server, real workers and a real gateway.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis
from fastapi.responses import Response
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.typing import EncodableT, FieldT

from gateway.app import error_response
from gateway.replies import TRIM_EVERY
from gateway.routes.pipelines import reply_response
from pipelines.envelope import (
    FIELD,
    Reply,
    Request,
    decode_reply,
    decode_request,
    new_request_id,
)
from pipelines.errors import ERROR_STATUSES, ConveyorError, EnvelopeError
from pipelines.records import JobField
from pipelines.registry import load_registry
from tests.helpers import Doubler, Harness, number_stage, until

# --------------------------------------------------------------------------------------
# Break 3: reply streams keep what was read.
# --------------------------------------------------------------------------------------

SOAK_REQUESTS = 3000
SOAK_CONCURRENCY = 32


@pytest.mark.timeout(180)
async def test_a_gateway_s_reply_stream_holds_only_what_it_has_not_read(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # BREAK (issue 23, 3): reply streams were capped only by count (MAXLEN ~ 100,000,
    # workers/publish.py) and the gateway never removed a reply it had read
    # (gateway/replies.py), so a gateway's stream grew with every request it served: in a
    # 10-minute soak Redis memory grew linearly (6.2 -> 16.3 MB); at the cap, ~740 MB of
    # 7.4 KB embed replies per gateway.
    # Observed: XLEN of the gateway's reply stream == requests served (3,000 here), and
    # it stays so after the load drains. Expected: it holds only unread replies (and
    # fewer than TRIM_EVERY read ones) while loaded, 0 (a few hundred bytes) after.
    # Trigger: 3,000 echo calls, 32 at a time, through a real gateway and a real worker.
    http = await harness.serve(load_registry(None, "echo"))
    pattern = harness.keys.reply_stream("*")
    text = "x" * 1000  # a 1 KB reply: what the stream would keep is visible in MEMORY USAGE
    assert (await http.post("/v1/echo", json={"text": text})).status_code == 200
    (stream,) = [key async for key in redis.scan_iter(match=pattern)]
    sent = iter(range(SOAK_REQUESTS))
    statuses: list[int] = []
    lengths: list[int] = []
    loaded = True

    async def client() -> None:
        for i in sent:
            answer = await http.post("/v1/echo", json={"text": text, "i": i})
            statuses.append(answer.status_code)

    async def sample() -> None:
        while loaded:
            lengths.append(await redis.xlen(stream))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    try:
        await asyncio.gather(*(client() for _ in range(SOAK_CONCURRENCY)))
    finally:
        loaded = False
        await sampler
    assert statuses == [200] * SOAK_REQUESTS, {s: statuses.count(s) for s in set(statuses)}
    assert lengths, "the sampler never ran"
    # Unread replies are bounded by the calls in flight (one reply each), read ones by
    # the trim's batch, whatever the number served.
    bound = SOAK_CONCURRENCY + TRIM_EVERY
    assert max(lengths) <= bound, f"XLEN peaked at {max(lengths)} while loaded"

    async def drained() -> bool:
        return bool(await redis.xlen(stream) == 0)

    await until(drained, 10)  # the trim after the last read may still be on its way
    used = await redis.memory_usage(stream, samples=0)
    assert used is None or used < 4096, f"an empty reply stream uses {used} bytes"


async def test_a_reply_is_trimmed_only_after_its_waiter_has_it(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Removing read replies must not lose one: a reply read but not yet dispatched must
    # not be trimmed (a call whose reply was trimmed first would end 504). The replies of
    # a batch of calls all arrive in one read; every call is answered, and only then is
    # the stream empty. Counterpart of the soak above, with a worker that answers in
    # batches of 16 (one XREAD returns them together).
    stage = number_stage(batch_wait_ms=200, max_batch_size=16)
    http = await harness.gateway([stage])
    worker = harness.worker(stage, Doubler())
    await worker.start()
    harness.run(worker)
    answers = await asyncio.gather(*(http.post("/v1/double", json={"value": i}) for i in range(64)))
    assert [a.json() for a in answers] == [{"value": 2 * i} for i in range(64)]
    (stream,) = [key async for key in redis.scan_iter(match=harness.keys.reply_stream("*"))]

    async def drained() -> bool:
        return bool(await redis.xlen(stream) == 0)

    await until(drained, 10)


# --------------------------------------------------------------------------------------
# Break 5: the gateway trusts a reply's status.
# --------------------------------------------------------------------------------------

FORGED: dict[str, dict[str, Any]] = {
    "status-0": {"outcome": "error", "error": "forged", "status": 0},
    "status-negative": {"outcome": "error", "error": "forged", "status": -5},
    "status-99999": {"outcome": "error", "error": "forged", "status": 99999},
    "status-101": {"outcome": "error", "error": "forged", "status": 101},
    "status-200-with-an-error-body": {"outcome": "error", "error": "forged", "status": 200},
    "status-204": {"outcome": "error", "error": "forged", "status": 204},
    "ok-without-a-result": {"outcome": "ok"},
    "ok-with-a-list-result": {"outcome": "ok", "result": [1, 2]},
    "error-without-a-message": {"outcome": "error", "status": 500},
}


async def _waiting_request(redis: aioredis.Redis, stream: str) -> Request:
    """The one request a gateway has enqueued on ``stream`` (no worker reads it)."""
    found: list[Any] = []

    async def enqueued() -> bool:
        found[:] = await redis.xrange(stream) or []
        return bool(found)

    await until(enqueued, 10)
    return decode_request(found[0][1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("forged", list(FORGED.values()), ids=list(FORGED))
async def test_a_forged_reply_answers_502_never_a_broken_response(
    harness: Harness,
    redis: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
    forged: dict[str, Any],
) -> None:
    # BREAK (issue 23, 5): the gateway answered with whatever ``status`` a reply entry
    # said (pipelines/envelope.py Reply.http_status -> gateway/routes/pipelines.py
    # reply_response -> ItemFailed(status=...)). A reply stream can be written by anyone
    # who can enqueue (the gateway's ACL user).
    # Observed: status 0, -5 or 99999: the connection dropped without a response; 101: an
    # invalid protocol upgrade; 200: an error body sent as a success; 204: no body.
    # Expected: the waiting client gets 502 with a JSON error naming its request, and the
    # gateway logs the entry; a well-formed reply is still answered as before.
    # Trigger: a call to a stage with no worker; an entry with its request id and that
    # status XADDed to the gateway's reply stream (the request's reply_to).
    stage = number_stage()
    base = await harness.http_server([stage])
    caplog.set_level(logging.WARNING, logger="gateway.replies")
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        call = asyncio.create_task(
            client.post("/v1/double", json={"value": 1}, headers={"X-Conveyor-Timeout": "20"})
        )
        request = await _waiting_request(redis, harness.keys.stage_stream("double"))
        entry = {"v": 1, "id": request.id, "stage": "double", **forged}
        await redis.xadd(request.reply_to, {FIELD: orjson.dumps(entry)})
        answer = await call
    assert answer.status_code == 502, (answer.status_code, answer.text)
    assert answer.json()["request_id"] == request.id
    assert answer.headers["x-request-id"] == request.id
    assert any(request.id in r.getMessage() and "502" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(60)
async def test_a_forged_partial_ends_a_stream_with_a_502_event(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # The same edge for Server-Sent Events: a forged reply (here a partial without a
    # result, which would have sent ``data: null`` as a token) ends the stream with an
    # ``error`` event of status 502, not a broken or hanging stream.
    registry = load_registry(None, "generate")
    base = await harness.http_server(registry)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        events: list[str] = []

        async def read() -> None:
            async with client.stream(
                "POST",
                "/v1/generate/stream",
                json={"text": "hi"},
                headers={"X-Conveyor-Timeout": "20"},
            ) as response:
                assert response.status_code == 200
                events.extend([line async for line in response.aiter_lines() if line])

        reading = asyncio.create_task(read())
        request = await _waiting_request(redis, harness.keys.stage_stream("generate"))
        entry = {"v": 1, "id": request.id, "stage": "generate", "outcome": "partial"}
        await redis.xadd(request.reply_to, {FIELD: orjson.dumps(entry)})
        await asyncio.wait_for(reading, 25)
    assert events[0] == "event: error", events
    assert json.loads(events[1].removeprefix("data: "))["status"] == 502


@pytest.mark.timeout(60)
async def test_an_entry_of_several_replies_answers_each_and_a_forged_one_502(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Issue 37: a batch's replies to one gateway are one entry (e, e1, e2, ...). Each is
    # validated alone: a forged one in the middle answers its own request 502, and the
    # replies before and after it answer theirs; a field past a gap (e4
    # where there is no e3) is not read as a reply.
    stage = number_stage()
    base = await harness.http_server([stage])
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        headers = {"X-Conveyor-Timeout": "20"}
        calls = [
            asyncio.create_task(client.post("/v1/double", json={"value": i}, headers=headers))
            for i in range(4)
        ]
        found: list[Any] = []

        async def enqueued() -> bool:
            found[:] = await redis.xrange(harness.keys.stage_stream("double")) or []
            return len(found) == 4

        await until(enqueued, 10)
        requests = sorted((decode_request(f) for _, f in found), key=lambda r: r.payload["value"])
        assert all(r.reply_batches for r in requests)  # this gateway reads several an entry
        replies = [
            {"v": 1, "id": r.id, "stage": "double", "outcome": "ok", "result": {"value": i}}
            for i, r in enumerate(requests)
        ]
        replies[1] = {
            "v": 1,
            "id": requests[1].id,
            "stage": "double",
            "outcome": "error",
            "status": 0,
        }
        fields: dict[FieldT, EncodableT] = {FIELD: orjson.dumps(replies[0])}
        fields[b"e1"] = orjson.dumps(replies[1])
        fields[b"e2"] = orjson.dumps(replies[2])
        fields[b"e4"] = orjson.dumps(replies[3])  # past the gap: not a reply of the entry
        await redis.xadd(requests[0].reply_to, fields)
        answered = await asyncio.gather(*calls[:3])
        assert not calls[3].done()
        await redis.xadd(requests[0].reply_to, {FIELD: orjson.dumps(replies[3])})
        last = await calls[3]
    assert [a.status_code for a in answered] == [200, 502, 200]
    assert answered[0].json() == {"value": 0}
    assert answered[2].json() == {"value": 2}
    assert last.json() == {"value": 3}


JOB_FORGERIES: dict[str, dict[FieldT, EncodableT]] = {
    "done-with-a-list-result": {JobField.STATUS: "done", JobField.RESULT: "[1, 2]"},
    "done-with-no-json": {JobField.STATUS: "done", JobField.RESULT: "not json"},
    "failed-with-status-0": {
        JobField.STATUS: "failed",
        JobField.ERROR: "x",
        JobField.HTTP_STATUS: "0",
    },
    "failed-with-status-200": {
        JobField.STATUS: "failed",
        JobField.ERROR: "x",
        JobField.HTTP_STATUS: "200",
    },
    "http-status-not-a-number": {JobField.STATUS: "failed", JobField.HTTP_STATUS: "abc"},
    "deadline-not-a-number": {JobField.DEADLINE: "soon"},
    "an-unknown-status": {JobField.STATUS: "exploded"},
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("forged", list(JOB_FORGERIES.values()), ids=list(JOB_FORGERIES))
async def test_a_forged_job_record_reads_back_as_a_502_failure(
    harness: Harness, redis: aioredis.Redis, forged: dict[FieldT, EncodableT]
) -> None:
    # BREAK (issue 23, 5, async jobs): a job's record is a hash the gateway's ACL user can
    # write, and GET /v1/jobs/{id} served whatever it held (pipelines/records.py
    # JobRecord.parse and view).
    # Observed: an http_status or deadline that is not a number, or a result that is not
    # JSON: 500 "internal error"; a result that is not an object, or an http_status of 0
    # or 200 for a failed job: served as if a worker had written it.
    # Expected: the job reads ``failed`` with http_status 502 and an error, and the
    # gateway logs it; reading it never crashes.
    # Trigger: a queued job (no worker), its hash overwritten with HSET.
    http = await harness.gateway([number_stage()])
    submitted = await http.post("/v1/jobs/double", json={"value": 1})
    assert submitted.status_code == 202
    job_id = submitted.json()["id"]
    await redis.hset(harness.keys.of(job_id).job(job_id), mapping=forged)
    answer = await http.get(f"/v1/jobs/{job_id}")
    assert answer.status_code == 200, answer.text
    view = answer.json()
    assert (view["status"], view["http_status"]) == ("failed", 502), view
    assert view["error"]
    cancelled = await http.delete(f"/v1/jobs/{job_id}")  # it reads as finished: 409
    assert cancelled.status_code == 409, cancelled.text


# Anything a reply entry's JSON may hold: the fields a Reply has, with values of the
# right type and of the wrong one, and numbers JSON cannot carry (``Infinity``).
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
_replies = st.fixed_dictionaries(
    {"id": st.text(min_size=1, max_size=8), "stage": st.text(max_size=8)},
    optional={
        "v": st.sampled_from([1, 2]),
        "outcome": st.sampled_from(["ok", "error", "expired", "cancelled", "partial", "done"]),
        "result": st.none() | st.dictionaries(st.text(max_size=4), _json, max_size=3) | _json,
        "error": st.none() | st.text(max_size=8) | st.integers(),
        "status": st.integers(min_value=-(2**70), max_value=2**70)
        | st.sampled_from([0, 101, 200, 204, 304, 404, 429, 499, 500, 599, 600])
        | st.floats()
        | st.text(max_size=4),
        "retry_after": st.none() | st.floats() | st.integers(),
    },
)


def _answer(reply: Reply) -> Response:
    # A reply answers only the request whose id it names, an id the gateway made.
    try:
        return reply_response(reply, new_request_id())
    except ConveyorError as exc:
        return error_response(exc)


@settings(max_examples=500, deadline=None)
@given(_replies)
def test_any_reply_that_decodes_maps_to_a_well_formed_http_answer(raw: dict[str, Any]) -> None:
    # BREAK (issue 23, 5), as a property: decode_reply accepted any int as ``status``, and
    # the gateway answered with it. Whatever an entry holds, either it is refused where it
    # enters the gateway (EnvelopeError: the dispatcher answers 502), or it maps to a
    # status that carries a body (200, or a 4xx/5xx an error may have), with a JSON
    # object as the body: the result when 200, ``{"detail": str, ...}`` otherwise.
    # Python's json writes NaN and Infinity, as a forger may; pydantic's parser reads them.
    try:
        reply = decode_reply(json.dumps(raw).encode())
    except EnvelopeError:
        return
    answer = _answer(reply)
    assert answer.status_code == 200 or answer.status_code in ERROR_STATUSES
    body = orjson.loads(answer.body)
    assert isinstance(body, dict)
    if answer.status_code != 200:
        assert isinstance(body["detail"], str | list)
    retry = answer.headers.get("retry-after")
    assert retry is None or 1 <= int(retry) <= 3600
