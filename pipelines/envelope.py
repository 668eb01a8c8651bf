"""The wire envelope: what one stream entry carries, and its encoding.

Each entry in a stage stream has a field ``e`` holding a JSON object and ``c``, the
request's estimated tokens (:mod:`pipelines.tokens`); a reply-stream entry holds one reply
or several (:func:`reply_values`).
An entry a join step receives also has one field ``b:<branch>`` per branch, holding that
branch's output as JSON (written by the join script in Redis, merged into ``state`` on
decoding). JSON (orjson) rather than msgpack: payloads are mostly text and float lists,
orjson encodes both faster than msgpack-python here, and any client can read it. No
pickle or other code-executing format is ever decoded; an entry that does not parse
and validate is rejected with :class:`~pipelines.errors.EnvelopeError`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import orjson
import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from redis.typing import EncodableT, FieldT

from pipelines.errors import (
    ERROR_STATUSES,
    RETRY_AFTER_MAX_S,
    EnvelopeError,
    bounded_detail,
)
from pipelines.keys import DEFAULT_LANE, Lane
from pipelines.outcomes import Outcome
from pipelines.tokens import COST, estimate

FIELD = b"e"
"""The stream-entry field that holds the encoded envelope."""
REPLIES_PER_ENTRY = 500
"""The most replies one reply-stream entry holds (a batch's replies to one gateway are
cut into entries of at most this many): a reader takes no more from one entry."""
BRANCH = b"b:"
"""Prefix of the fields carrying branch outputs into a join step."""

MAX_DEPTH = 64
"""The most nested arrays and objects a payload or a step's output may have. The envelope
wraps a payload in three more levels, and the decoder (pydantic-core) refuses about 200:
anything within this bound decodes at every hop of a pipeline."""
INT_RANGE = (-(2**63), 2**64 - 1)
"""The integers the encoder (orjson) writes exactly; anything outside it cannot be sent."""
EPOCH_MAX_S = 1e10
"""The latest instant (seconds since the epoch, in the year 2286) an envelope may name:
a deadline or an ``enqueue_by`` past it is refused when the entry is decoded, so every
sum, expiry and ``int()`` of one downstream stays finite and within Redis's range."""
NAME_MAX = 512
"""The longest pipeline, stage, step or reply address an envelope may carry."""


class WireProblem(NamedTuple):
    """Why a value cannot travel in an envelope, in the shape of a validation error.

    Attributes:
        loc: where, from the root (keys and list indexes).
        msg: what is wrong.
        type: a short machine-readable kind (``too_deep``, ``non_finite``, ...).
    """

    loc: tuple[str | int, ...]
    msg: str
    type: str


def wire_problem(value: object, loc: tuple[str | int, ...] = ()) -> WireProblem | None:
    """The first thing in ``value`` an envelope cannot carry faithfully, or None.

    This is the one definition of what a request may contain: the gateway refuses a
    payload with a problem before anything is enqueued (422), and a worker fails an item
    whose output has one (422) instead of publishing a value the next hop would refuse or
    the encoder would silently change (a NaN written as ``null``).

    Carried: ``None``, ``bool``, ``str`` without lone surrogates, ``int`` in
    :data:`INT_RANGE`, finite ``float``, and lists, tuples and ``str``-keyed dicts of
    them nested at most :data:`MAX_DEPTH` deep.
    """
    stack: list[tuple[object, tuple[str | int, ...], int]] = [(value, loc, 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            if depth >= MAX_DEPTH:
                return WireProblem(where, f"nested deeper than {MAX_DEPTH} levels", "too_deep")
            if isinstance(item, dict):
                for key, child in item.items():
                    if not isinstance(key, str):
                        return WireProblem(where, "object keys must be strings", "key_type")
                    if not _utf8(key):
                        return WireProblem(where, "key is not valid Unicode", "lone_surrogate")
                    stack.append((child, (*where, key), depth + 1))
            elif not _plain(item):
                stack.extend((child, (*where, i), depth + 1) for i, child in enumerate(item))
        elif isinstance(item, str):
            if not _utf8(item):
                return WireProblem(
                    where, "string is not valid Unicode (lone surrogate)", "lone_surrogate"
                )
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if not INT_RANGE[0] <= item <= INT_RANGE[1]:
                return WireProblem(
                    where, f"integer outside [{INT_RANGE[0]}, {INT_RANGE[1]}]", "int_range"
                )
        elif isinstance(item, float):
            if not math.isfinite(item):
                return WireProblem(where, "number is not finite (NaN or infinity)", "non_finite")
        else:
            return WireProblem(where, f"{type(item).__name__} is not a JSON value", "json_type")
    return None


def _utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _plain(items: list[Any] | tuple[Any, ...]) -> bool:
    """Whether ``items`` are all finite floats, all in-range ints or all valid strings,
    decided in C for the common cases (an embedding, token ids, a list of texts); False
    sends the caller through the items one by one."""
    kinds = set(map(type, items))
    if kinds == {float}:
        return math.isfinite(sum(items))  # an overflowing sum only costs the slow path
    if kinds == {int}:
        return bool(INT_RANGE[0] <= min(items) and max(items) <= INT_RANGE[1])
    if kinds == {str}:
        return _utf8("".join(items))
    return False


class Request(BaseModel):
    """A request travelling to a stage.

    Attributes:
        v: envelope version.
        id: request id, unique per client request.
        pipeline: the pipeline the request was made to.
        stage: the stage (stream) this entry is for.
        step: the pipeline step this entry runs.
        payload: the step's input (for a join step, built by the consumer from ``state``).
        state: the request's context: ``input`` and each finished step's output.
        deadline: absolute deadline, seconds since the epoch on the Redis clock.
        reply_to: the reply stream of the gateway that waits for the result.
        attempt: how many times this request has been delivered before (0 first).
        trace_id: carried unchanged through every stage and log line.
        stream: the client wants partial output as it is produced (streaming models).
        enqueue_by: when the gateway stops waiting for its write (Redis clock): an entry
            that arrived later (its stream id says when) was refused to its client with a
            503 and must never take effect.
        lane: its priority lane (:data:`~pipelines.keys.Lane`), kept at every step of
            its pipeline.
        traceparent: the W3C trace context of its root span at the gateway, when tracing
            is on (:mod:`runtime.tracing`); kept at every step, so each process's spans
            join the one trace.
        reply_batches: the gateway at ``reply_to`` reads an entry of several replies
            (:func:`reply_values`), so a batch's replies to it may share one; absent (a
            gateway of an earlier release, which reads ``e`` alone), each reply is an
            entry of its own.
    """

    # A newer process's added fields are ignored, so a rolling deploy in either order
    # keeps working; an incompatible change bumps ``v``, which is refused.
    model_config = ConfigDict(frozen=True, extra="ignore")

    # Every number is bounded here, where an entry enters a worker: an entry is
    # untrusted (any holder of a write ACL can XADD one), and a value that passes this
    # model must not be able to raise anywhere past it, the dead-letter path included.
    v: Literal[1] = 1
    id: str = Field(min_length=1, max_length=128)
    pipeline: str = Field(max_length=NAME_MAX)
    stage: str = Field(max_length=NAME_MAX)
    step: str = Field(max_length=NAME_MAX)
    payload: dict[str, Any]
    state: dict[str, Any] = Field(default_factory=dict)
    deadline: float = Field(ge=0, le=EPOCH_MAX_S, allow_inf_nan=False)
    reply_to: str = Field(max_length=NAME_MAX)
    attempt: int = Field(default=0, ge=0, le=2**31)
    trace_id: str = Field(default_factory=lambda: new_request_id(), max_length=128)
    stream: bool = False
    enqueue_by: float | None = Field(default=None, ge=0, le=EPOCH_MAX_S, allow_inf_nan=False)
    lane: Lane = DEFAULT_LANE
    traceparent: str | None = Field(default=None, max_length=256)
    reply_batches: bool = False


class Reply(BaseModel):
    """The outcome of one request, published to its ``reply_to`` stream.

    Attributes:
        v: envelope version.
        id: the request id.
        stage: the stage that produced it.
        outcome: ``ok``, ``error`` (a step failed on this item), ``expired``,
            ``cancelled`` (see :class:`~pipelines.errors.Cancelled`), or ``partial``
            (streamed output so far; more replies follow).
        result: the response when ``outcome`` is ``ok``; ``{"text": new_text, "at":
            offset}`` when ``partial`` (``at``: where the text starts in the whole; the
            gateway skips what it already sent, and never shows ``at`` to the client).
        error: a client-safe message otherwise.
        status: the HTTP status an error maps to: one of
            :data:`~pipelines.errors.ERROR_STATUSES` when ``outcome`` is ``error``, and
            200 or one of those otherwise (where it is not what answers).
        retry_after: seconds, for an error worth retrying later (a value that is not a
            finite number >= 0 is dropped; one over an hour is an hour).
        trace_id: the request's trace id.

    Whatever a reply says is checked here, where it enters a process (a reply stream is
    writable by anyone who can enqueue): its status is one the HTTP API documents and its
    body matches its outcome (a result object the wire can carry, see
    :func:`wire_problem`, when ``ok`` or ``partial``; an error message when ``error``), so
    every reply that validates maps to a well-formed answer.
    """

    # A newer process's added fields are ignored, so a rolling deploy in either order
    # keeps working; an incompatible change bumps ``v``, which is refused.
    model_config = ConfigDict(frozen=True, extra="ignore")

    v: Literal[1] = 1
    id: str
    stage: str
    outcome: Outcome | Literal["partial"]
    result: dict[str, Any] | None = None
    error: str | None = None
    status: int = 200
    retry_after: float | None = None
    trace_id: str = ""

    @field_validator("error")
    @classmethod
    def _bounded_error(cls, value: str | None) -> str | None:
        # Served as a response's detail: a forged megabyte would be served whole.
        return None if value is None else bounded_detail(value)

    @field_validator("retry_after")
    @classmethod
    def _bounded_wait(cls, value: float | None) -> float | None:
        # A worker bounds what a step said; a forged infinity or NaN must not reach a
        # Retry-After header, and refusing the whole reply for a hint would be harsher.
        if value is None or not math.isfinite(value) or value < 0:
            return None
        return min(value, RETRY_AFTER_MAX_S)

    @model_validator(mode="after")
    def _consistent(self) -> Reply:
        if self.status != 200 and self.status not in ERROR_STATUSES:
            raise ValueError(f"status {self.status} is not one conveyor answers with")
        if self.outcome in (Outcome.OK, "partial"):
            if self.result is None:
                raise ValueError(f"an {self.outcome!r} reply has no result")
            # What a worker checks before it publishes (workers/contract.py: checked): the
            # JSON parser reads what the encoder cannot write back (NaN, 2**64). A type
            # that is not JSON's comes only from a worker's own result (decoding makes
            # none), which checked() let through as one the encoder writes (numpy's).
            problem = wire_problem(self.result, ("result",))
            if problem is not None and problem.type != "json_type":
                raise ValueError(f"{'.'.join(map(str, problem.loc))}: {problem.msg}")
        elif self.outcome is Outcome.ERROR:
            if self.status not in ERROR_STATUSES:
                raise ValueError(f"an error reply's status is {self.status}, not an error's")
            if self.error is None:
                raise ValueError("an error reply has no error message")
        return self

    @property
    def http_status(self) -> int:
        """The HTTP status this reply answers its request with: its outcome's
        (:attr:`Outcome.http_status`), or for an ``error`` (and ``partial``) ``status``,
        what the worker mapped the failure to."""
        if self.outcome == "partial" or self.outcome is Outcome.ERROR:
            return self.status
        return self.outcome.http_status


def new_request_id() -> str:
    """A fresh random request id: 32 hex digits of the OS's randomness (what
    ``uuid4().hex`` gave, without building a UUID: a sixth of its cost, twice a request)."""
    return os.urandom(16).hex()


def encode(message: Request | Reply) -> dict[FieldT, EncodableT]:
    """Stream-entry fields for ``message`` (what XADD takes): a request also carries its
    estimated tokens (:mod:`pipelines.tokens`), read by length-aware batching."""
    if isinstance(message, Request):
        return {FIELD: dumps(message), COST: estimate(message.payload)}
    return {FIELD: dumps(message)}


def dumps(message: Request | Reply) -> bytes:
    """The JSON of ``message`` (the value of the ``e`` field)."""
    return orjson.dumps(message.model_dump(mode="json"))


def _field(fields: Mapping[Any, Any]) -> bytes:
    try:
        value: bytes = fields[FIELD]
        return value
    except KeyError:
        raise EnvelopeError(f"entry has no {FIELD.decode()!r} field") from None


def decode_request(fields: Mapping[Any, Any]) -> Request:
    """Parse and validate a stage-stream entry.

    Args:
        fields: the entry's fields as redis-py returns them (bytes keys and values).

    Raises:
        EnvelopeError: the entry is not a valid version-1 request envelope.
    """
    try:
        request = Request.model_validate_json(_field(fields))
    except ValidationError as exc:
        raise EnvelopeError(f"invalid request envelope: {exc.error_count()} error(s)") from exc
    branches = {k: v for k, v in fields.items() if k.startswith(BRANCH)}
    state = dict(request.state)
    for key, value in branches.items():
        try:
            state[key[len(BRANCH) :].decode()] = orjson.loads(value)
        except (orjson.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EnvelopeError(f"invalid branch field {key!r}") from exc
    # What the gateway refuses at its edge (wire_problem), a worker refuses at its own: the
    # decoder reads Infinity, NaN and integers of any size, which would be carried on to
    # a model, or fail the batch's publish (the encoder refuses them).
    for where, value in [
        (("payload",), request.payload),
        *((("state", k), v) for k, v in state.items()),
    ]:
        problem = wire_problem(value, where)
        if problem is not None:
            at = ".".join(map(str, problem.loc))
            raise EnvelopeError(f"the envelope cannot be carried on ({at}: {problem.msg})")
    return request.model_copy(update={"state": state}) if branches else request


class Sender(NamedTuple):
    """Who an entry that does not decode came from, as far as its JSON still says."""

    id: str
    step: str
    reply_to: str
    trace_id: str


def sender(fields: Mapping[Any, Any]) -> Sender | None:
    """The request id, step and reply address of an entry :func:`decode_request`
    refused, read leniently, so its caller can still be told; None when unreadable."""
    try:
        # The decoder the envelope was refused by (it reads what orjson refuses, e.g.
        # ``Infinity``), so an entry refused for its numbers still names its sender.
        raw = pydantic_core.from_json(fields[FIELD], allow_inf_nan=True)
    except (KeyError, TypeError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    found = [raw.get(name) for name in ("id", "step", "reply_to", "trace_id")]
    if not all(isinstance(value, str) and value for value in found[:3]):
        return None
    rid, step, reply_to, trace = (v if isinstance(v, str) else "" for v in found)
    return Sender(rid, step, reply_to, trace)


def reply_values(fields: Mapping[Any, Any]) -> list[bytes]:
    """The replies a reply-stream entry holds, in order: its ``e`` field's, then ``e1``'s,
    ``e2``'s and so on (a batch's replies to one gateway are one entry:
    ``workers/publish.lua``); none when it has no ``e``. At most the first
    :data:`REPLIES_PER_ENTRY` (no worker writes more): the gateway decodes, answers and
    logs no more from a forged entry of many fields than from a real one (reading it off
    the connection still costs its size)."""
    first = fields.get(FIELD)
    if first is None:
        return []
    values = [first]
    while len(values) < REPLIES_PER_ENTRY:
        more = fields.get(FIELD + str(len(values)).encode())
        if more is None:
            break
        values.append(more)
    return values


def replier(raw: bytes) -> tuple[str, str] | None:
    """The request id and stage of a reply :func:`decode_reply` refused, read leniently,
    so the request waiting for it can still be answered; None when unreadable."""
    try:
        found = orjson.loads(raw)
    except (TypeError, orjson.JSONDecodeError):
        return None
    if not isinstance(found, dict):
        return None
    rid, stage = found.get("id"), found.get("stage")
    if not isinstance(rid, str) or not rid:
        return None
    return rid, stage if isinstance(stage, str) else ""


def decode_reply(raw: bytes) -> Reply:
    """Parse and validate one reply (one of :func:`reply_values`).

    Raises:
        EnvelopeError: it is not a valid version-1 reply envelope, or says what no
            worker does (see :class:`Reply`).
    """
    try:
        return Reply.model_validate_json(raw)
    except ValidationError as exc:
        # Where and what, never the input: a reply may hold a client's data.
        first = exc.errors(include_input=False, include_url=False)[0]
        where = ".".join(map(str, first["loc"])) or "reply"
        raise EnvelopeError(
            f"invalid reply envelope: {exc.error_count()} error(s); {where}: {first['msg']}"
        ) from exc


def decode_replies(fields: Mapping[Any, Any]) -> list[Reply]:
    """Parse and validate every reply of a reply-stream entry (:func:`reply_values`).

    Raises:
        EnvelopeError: the entry holds no reply, or one that :func:`decode_reply` refuses.
    """
    values = reply_values(fields)
    if not values:
        raise EnvelopeError(f"entry has no {FIELD.decode()!r} field")
    return [decode_reply(raw) for raw in values]
