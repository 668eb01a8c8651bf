"""The request headers a client may send, each declared once.

A :class:`RequestHeader` names a header, says what it holds (its type, bounds and
schema), how the hot path reads a plainly valid value from the raw bytes, and its
default on each kind of route. Everything that reads or allows a header is derived from
:data:`HEADERS`: the FastAPI parameters of every route (:func:`sent_on`, so the 422s and
the OpenAPI document come from here), the hot path's parser
(:func:`gateway.fastpath.plain_headers`), and the CORS allow-list (:data:`CORS_HEADERS`).
A header added here is read, documented and allowed across origins everywhere at once.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import Depends, Header
from pydantic import WithJsonSchema

from pipelines.keys import DEFAULT_LANE, LANES, Lane
from runtime import tracing

RouteKind = Literal["call", "stream", "job"]
"""A kind of route reading the headers: a sync call (``POST``/``GET /v1/{name}``), a
streaming call (``/v1/{name}/stream``), or an async job's submission."""


class Unclear:
    """What a hot-path parser returns for a value it is not sure of: the route decides."""


UNCLEAR = Unclear()
_NUMBER = re.compile(rb"[0-9]{1,12}(\.[0-9]{1,12})?")
TRACE_MAX = 128


@dataclass(frozen=True)
class RequestHeader:
    """One request header, declared once.

    Attributes:
        name: the header as sent (``X-Conveyor-Timeout``).
        param: the name its value has in a route and in :class:`Sent`.
        type: the Python type of a valid value.
        description: what it means (in the OpenAPI document).
        schema: its JSON schema (a header is never null: absent, or this).
        constraints: what FastAPI checks beyond the type (``gt``, ``max_length``, ...).
        parse: the hot path's reading of the raw value: the value where it is plainly
            valid, else :data:`UNCLEAR` (the route then reads it, and refuses it its way).
        defaults: its value when absent, per kind of route (None where not given).
    """

    name: str
    param: str
    type: Any
    description: str
    schema: dict[str, Any]
    parse: Callable[[bytes], Any]
    constraints: Mapping[str, Any] = field(default_factory=dict)
    defaults: Mapping[RouteKind, Any] = field(default_factory=dict)

    @property
    def key(self) -> bytes:
        """The name as an ASGI scope carries it (lower case bytes)."""
        return self.name.lower().encode()

    @property
    def annotation(self) -> Any:
        """The FastAPI parameter reading it: absent, or a valid value, else a 422."""
        header = Header(alias=self.name, description=self.description, **self.constraints)
        return Annotated[self.type | None, header, WithJsonSchema(self.schema)]


def _timeout(raw: bytes) -> float | Unclear:
    if _NUMBER.fullmatch(raw) is None or float(raw) <= 0:
        return UNCLEAR
    return float(raw)


def _trace(raw: bytes) -> str | Unclear:
    return UNCLEAR if len(raw) > TRACE_MAX else raw.decode("latin-1")  # as Starlette does


_LANE_BYTES: dict[bytes, Lane] = {lane.encode(): lane for lane in LANES}


def _lane(raw: bytes) -> Lane | Unclear:
    return _LANE_BYTES.get(raw, UNCLEAR)


TIMEOUT = RequestHeader(
    name="X-Conveyor-Timeout",
    param="timeout_s",
    type=float,
    description="Deadline in seconds (capped at CONVEYOR_MAX_TIMEOUT_S; absent: "
    "CONVEYOR_DEFAULT_TIMEOUT_S, or CONVEYOR_JOB_TIMEOUT_S for a job).",
    schema={"type": "number", "exclusiveMinimum": 0},
    constraints={"gt": 0, "allow_inf_nan": False},
    parse=_timeout,
)
TRACE = RequestHeader(
    name="X-Trace-Id",
    param="trace",
    type=str,
    description="The caller's trace id, kept with the request at every step.",
    schema={"type": "string", "maxLength": TRACE_MAX},
    constraints={"max_length": TRACE_MAX},
    parse=_trace,
)
PRIORITY = RequestHeader(
    name="X-Conveyor-Priority",
    param="lane",
    type=Lane,
    description="The request's lane: `interactive` (taken first; the default of sync and "
    "streaming calls) or `bulk` (fills the batches; the default of jobs).",
    schema={"type": "string", "enum": list(LANES)},
    parse=_lane,
    # A job is not waited on: it fills the batches.
    defaults={"call": DEFAULT_LANE, "stream": DEFAULT_LANE, "job": "bulk"},
)
HEADERS: tuple[RequestHeader, ...] = (TIMEOUT, TRACE, PRIORITY)
"""Every conveyor request header, in the order routes list them."""

CORS_HEADERS: tuple[str, ...] = (
    # Read by the edge (API keys), the body parser and the tracing middleware.
    "Authorization",
    "Content-Type",
    "X-API-Key",
    tracing.TRACEPARENT,
    *(h.name for h in HEADERS),
)
"""What a browser may send across origins: every header the gateway reads."""


@dataclass(frozen=True, slots=True)
class Sent:
    """A request's headers as a route uses them, defaults applied.

    Attributes:
        timeout_s: ``X-Conveyor-Timeout``, if sent (the gateway's settings decide else).
        trace: ``X-Trace-Id``, if sent.
        lane: ``X-Conveyor-Priority``, or the route's default lane.
    """

    timeout_s: float | None
    trace: str | None
    lane: Lane

    @classmethod
    def of(cls, route: RouteKind, values: Mapping[str, Any]) -> Sent:
        """The headers read (each by its :attr:`RequestHeader.param`; None or missing
        where absent) with ``route``'s defaults for the absent ones."""
        read: dict[str, Any] = {
            h.param: h.defaults.get(route) if values.get(h.param) is None else values[h.param]
            for h in HEADERS
        }
        return cls(**read)


def parameters() -> list[inspect.Parameter]:
    """Every header as a keyword parameter of a FastAPI endpoint (None when absent)."""
    kw = inspect.Parameter.KEYWORD_ONLY
    return [inspect.Parameter(h.param, kw, default=None, annotation=h.annotation) for h in HEADERS]


def sent_on(route: RouteKind) -> Any:
    """A FastAPI dependency reading every header for a ``route`` kind of route: annotate
    a parameter ``Annotated[Sent, sent_on("call")]``."""

    # async: FastAPI runs a plain function dependency in a thread, a hop per request.
    async def read(**values: Any) -> Sent:
        return Sent.of(route, values)

    read.__signature__ = inspect.Signature(parameters())  # type: ignore[attr-defined]
    return Depends(read)
