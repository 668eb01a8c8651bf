"""Property tests: whatever the gateway admits, every worker can decode.

The gateway decides with :func:`~pipelines.envelope.wire_problem` (and the body parser
that feeds it); the workers decode with :func:`~pipelines.envelope.decode_request`. Any
value the first admits must survive the second unchanged, at any hop of a pipeline.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson
import pytest
from fastapi import HTTPException
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.body import parse_body
from pipelines.envelope import (
    FIELD,
    INT_RANGE,
    MAX_DEPTH,
    REPLIES_PER_ENTRY,
    Reply,
    Request,
    decode_reply,
    decode_request,
    dumps,
    reply_values,
    wire_problem,
)
from pipelines.errors import EnvelopeError
from pipelines.outcomes import Outcome

# Anything JSON-shaped, hostile leaves included: NaN, infinities, ints of any size,
# strings with lone surrogates, and deep nesting.
leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63 - 2, max_value=2**64 + 2)
    | st.floats()
    | st.text()
    | st.text(alphabet=st.characters(min_codepoint=0xD7FF, max_codepoint=0xE000))
)
values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=40,
)


def deep(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def envelope(payload: dict[str, Any]) -> Request:
    return Request(
        id="r",
        pipeline="p",
        stage="s",
        step="s",
        payload=payload,
        state={"input": payload, "previous": payload},
        deadline=1.0,
        reply_to="reply",
    )


def same(a: Any, b: Any) -> bool:
    """Equal as JSON values (a tuple reads back as a list; -0.0 equals 0.0)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_what_is_admitted_round_trips_through_every_hop(value: Any) -> None:
    payload = {"x": value}
    if wire_problem(payload) is not None:
        return
    request = decode_request({FIELD: dumps(envelope(payload))})
    assert same(request.payload, payload)
    assert same(request.state["previous"], payload)
    # ... and as a step's output on its way back to the gateway.
    reply = decode_reply(dumps(Reply(id="r", stage="s", outcome=Outcome.OK, result=payload)))
    assert same(reply.result, payload)


@settings(max_examples=300)
@given(values)
def test_what_is_refused_could_not_have_travelled(value: Any) -> None:
    problem = wire_problem({"x": value})
    if problem is None:
        return
    # The refusal names a real place in the value, holding what it says.
    here: Any = {"x": value}
    for key in problem.loc:
        here = here[key]
    if problem.type == "non_finite":
        assert not math.isfinite(here)
    elif problem.type == "int_range":
        assert not INT_RANGE[0] <= here <= INT_RANGE[1]
    elif problem.type == "lone_surrogate":
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in here) or isinstance(here, dict)


@settings(max_examples=300)
@given(values)
def test_a_body_the_gateway_parses_is_one_a_worker_decodes(value: Any) -> None:
    try:
        raw = json.dumps({"x": value}).encode()  # NaN as NaN, surrogates as \\ud800
    except (ValueError, RecursionError):
        return
    try:
        parsed = parse_body(raw)
    except (HTTPException, json.JSONDecodeError):
        return  # refused with a 422: nothing enqueued; anything else would be a 500
    decode_request({FIELD: dumps(envelope(parsed))})


@given(st.integers(min_value=MAX_DEPTH - 2, max_value=MAX_DEPTH + 2))
def test_depth_bound_is_exact_and_within_the_decoder(depth: int) -> None:
    payload = {"x": deep(depth - 1, 1)}  # the object itself is one level
    admitted = wire_problem(payload) is None
    assert admitted == (depth <= MAX_DEPTH)
    if admitted:
        decode_request({FIELD: dumps(envelope(payload))})


def test_a_newer_envelope_with_added_fields_still_decodes() -> None:
    # A rolling deploy runs a newer gateway beside older workers: its additions are ignored.
    raw = orjson.loads(dumps(envelope({"x": 1}))) | {"priority": "bulk"}
    assert decode_request({FIELD: orjson.dumps(raw)}).payload == {"x": 1}
    newer = orjson.loads(dumps(envelope({"x": 1}))) | {"v": 2}
    with pytest.raises(EnvelopeError):  # an incompatible version is refused
        decode_request({FIELD: orjson.dumps(newer)})


def test_a_reply_answers_with_the_status_its_outcome_maps_to() -> None:
    # The one mapping the sync route, the SSE error event and a job's record all use.
    assert Reply(id="r", stage="s", outcome=Outcome.OK, result={}).http_status == 200
    assert Reply(id="r", stage="s", outcome=Outcome.ERROR, error="x", status=422).http_status == 422
    assert Reply(id="r", stage="s", outcome=Outcome.EXPIRED, error="late").http_status == 504
    assert Reply(id="r", stage="s", outcome=Outcome.OK, result={}, status=500).http_status == 200
    ok = Reply(id="r", stage="s", outcome=Outcome.OK, result={})
    assert "http_status" not in orjson.loads(dumps(ok))


numbers = st.integers() | st.floats() | st.sampled_from(["Infinity", "-Infinity", "NaN"])


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(deadline=numbers, enqueue_by=numbers | st.none(), attempt=numbers)
def test_an_envelope_that_decodes_can_always_be_ended(
    deadline: Any, enqueue_by: Any, attempt: Any
) -> None:
    # Issue 23, break 1: a decoded deadline of Infinity made ending the request raise
    # (OverflowError), in the dead-letter path too. Whatever decodes must end cleanly.
    from pipelines.builtin import builtin_pipelines
    from pipelines.registry import Registry
    from pipelines.settings import CommonSettings
    from workers.route import Router
    from workers.values import Outbox

    raw = {"deadline": deadline, "enqueue_by": enqueue_by, "attempt": attempt}
    fields = dict(envelope({"value": 1}).model_dump(mode="json"), step="adder")
    fields |= {"pipeline": "chain", "stage": "adder", "reply_to": "conveyor:reply:g"}
    body = json.dumps(fields | {k: v for k, v in raw.items()})
    for literal in ("Infinity", "-Infinity", "NaN"):  # as a forged entry would write them
        body = body.replace(f'"{literal}"', literal)
    try:
        req = decode_request({FIELD: body.encode()})
    except EnvelopeError:
        return
    assert math.isfinite(req.deadline)
    keys = CommonSettings(namespace="conveyor").keys
    router = Router(Registry(builtin_pipelines()), keys, "adder")
    for now in (0.0, 1.7e9, 4e9):
        out = Outbox()
        router.fail(out, req, Outcome.ERROR, "dead-lettered", status=500, now=now)
        router.late(out, req, now)
        router.cancel(out, req, now)
        assert all(0 < e.marker_ttl_s < 2**31 for e in out.effects.values())


def test_a_reply_entry_is_read_to_its_bound_whatever_it_holds() -> None:
    # A reply-stream entry is untrusted: of one of fields e, e1, ... e600 the gateway
    # decodes no more than of a real one (no worker writes more than 500 replies an
    # entry); a field past a gap is not read.
    fields = {FIELD: b"x0"} | {FIELD + b"%d" % i: b"x%d" % i for i in range(1, 601)}
    assert reply_values(fields) == [b"x%d" % i for i in range(REPLIES_PER_ENTRY)]
    assert reply_values({FIELD: b"a", b"e1": b"b", b"e3": b"d"}) == [b"a", b"b"]
    assert reply_values({b"e1": b"b"}) == []
