"""The gateway's part of a request's trace (only when tracing is on: :mod:`runtime.tracing`).

FastAPI's own OpenTelemetry support opens each request's root span (kind SERVER,
continuing a W3C ``traceparent`` the client sent) once a tracer provider is configured,
and makes it current while the request is served. The gateway adds under it:

- ``admission`` and ``enqueue``: deciding to take the request, and writing it to its
  entry stage's stream;
- ``reply``: from the moment the last stage wrote the reply (its entry id, on the Redis
  clock) until the gateway had it in hand;

and :class:`TraceHeaders` answers every request with its ``traceparent`` and logs one
line per request carrying its trace id, so the gateway's log and the trace meet.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.trace import Span
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipelines.envelope import Request
from pipelines.keys import Lane
from runtime import tracing
from runtime.redisio import RedisClock

logger = logging.getLogger(__name__)

_route_selected: Callable[..., None] | None
try:  # FastAPI's router names a request's telemetry after the route it selected, by this
    from fastapi.telemetry._api import _route_selected
except ImportError:  # a FastAPI without telemetry of its own: the span is named below
    _route_selected = None

TELEMETRY = "fastapi.telemetry"
"""The scope key of FastAPI's per-request telemetry (its root span, the route its duration
metric and log events carry)."""


def answered_as(scope: Scope, route: str) -> None:
    """The hot path (:mod:`gateway.fastpath`) answers the request as ``route`` (its path:
    ``/v1/{pipeline}``, ``/v1/jobs/{pipeline}``, or an OpenAI-compatible route), where
    FastAPI's router never runs: its root span, and FastAPI's own telemetry of it, are
    named after that route as the router names them, whatever its answer (a refusal
    included)."""
    if _route_selected is not None and TELEMETRY in scope:
        try:
            _route_selected(scope=scope, path=route)
            return
        except TypeError:  # its private signature changed: name the span, at least
            pass
    root = current()
    if root is not None:
        root.update_name(f"{scope['method']} {route}")
        root.set_attribute("http.route", route)


def current() -> Span | None:
    """The request's root span, when tracing is on and one is recording."""
    if not tracing.STATE.enabled:
        return None
    span = trace.get_current_span()
    return span if span.is_recording() else None


def child(root: Span, name: str, start_s: float, end_s: float, **attributes: object) -> None:
    """Record the finished span ``name`` under ``root`` (times on the Redis clock)."""
    tracing.span(name, tracing.under_span(root), start_s, end_s, attributes)


class Enqueueing:
    """The ``admission`` and ``enqueue`` spans of one request under its root span, timed
    on ``clock``; nothing is recorded when tracing is off (no root span).

    Args:
        clock: the Redis clock.
    """

    def __init__(self, clock: RedisClock) -> None:
        self.clock = clock
        self.root = current()
        self.started = clock.now() if self.root is not None else 0.0
        self.admitted = 0.0

    def admission(self, lane: Lane) -> None:
        """The request was admitted: its ``admission`` span ends now."""
        if self.root is None:
            return
        self.admitted = self.clock.now()
        child(self.root, "admission", self.started, self.admitted, **{"conveyor.lane": lane})

    def trace_id(self, sent: str | None) -> str | None:
        """The request's trace id: the caller's, else the root span's (None: neither)."""
        if self.root is None:
            return sent
        return sent or tracing.trace_id_of(self.root)

    def traceparent(self) -> str | None:
        """The ``traceparent`` the request carries on to the workers (None: not traced)."""
        return tracing.traceparent_of(self.root) if self.root is not None else None

    def enqueued(self, request: Request) -> None:
        """``request`` was written: its ``enqueue`` span ends now."""
        if self.root is not None:
            attributes = {"conveyor.request_id": request.id, "conveyor.stage": request.stage}
            child(self.root, "enqueue", self.admitted, self.clock.now(), **attributes)


class TraceHeaders:
    """ASGI middleware (added only when tracing is on): each response carries the
    request's ``traceparent``, and each request is logged with its trace id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        root = current() if scope["type"] == "http" else None
        if root is None:
            await self.app(scope, receive, send)
            return
        header = tracing.traceparent_of(root).encode()
        started = time.perf_counter()
        status = 0

        async def send_with_header(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message["headers"], (b"traceparent", header)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_header)
        finally:
            logger.info(
                "%s %s %d in %.1f ms trace=%s",
                scope["method"],
                scope["path"],
                status,
                (time.perf_counter() - started) * 1000,
                tracing.trace_id_of(root),
            )
