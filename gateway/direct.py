"""Calls answered on their connection: ``POST /v1/{pipeline}``, a job's submission
(``POST /v1/jobs/{pipeline}``) and the OpenAI-compatible POSTs (``/v1/embeddings``, and
``/v1/completions`` and ``/v1/chat/completions`` not asked to stream) read, admitted,
enqueued, awaited and answered by conveyor's uvicorn protocol (:mod:`gateway.protocol`)
itself, without an ASGI cycle, when nothing about the request needs more.

Through uvicorn, every call passes its request-response cycle, a task running the
middleware stack (uvicorn's proxy headers, FastAPI's error handler, the edge, the hot path
of :mod:`gateway.fastpath`) and a Starlette response sent in ASGI messages: on echo at 64
clients about a quarter of the gateway's CPU a request. A call taken here does what that
stack would do for it and no more, in the same order: the edge's key check (a request
without a valid key is left to the edge, which answers 401; a job is owned by the key's
identity, as the edge names it), its body limit (a declared length within it; anything
else is the edge's), the hot path's reading of the headers and the body
(:func:`~gateway.fastpath.plain_headers` with the route's defaults, the input model's
validation, or the OpenAI route's body and ``model``), the hot path's answer for the route
(:meth:`Gateway.call <gateway.service.Gateway.call>` and
:func:`~gateway.routes.pipelines.reply_response`; :func:`~gateway.routes.jobs.submit_job`;
the OpenAI route's :class:`~gateway.routes.openai.serving.Direct`) and its errors in the
route's shape, the edge's metrics and access line.

A completion asked to stream (``"stream": true``) is left to the app: its answer is
written as it comes, not as one response.

The protocol asks :meth:`DirectCalls.take` once a request's headers are complete and
:meth:`DirectCalls.validated` once its body is; where either says no (a CORS request, an
``Expect``, a chunked body, a body that is not valid input, tracing on, ...) the request
goes to uvicorn's cycle with its body replayed, and FastAPI answers it as ever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from gateway.edge import ANONYMOUS, EdgeMiddleware
from gateway.enqueue import refusal
from gateway.fastpath import Job, Route, SyncCalls, plain_headers
from gateway.headers import Sent
from gateway.protocol import APP, DISCONNECT, Disconnect
from gateway.routes import json_response
from gateway.routes.openai.serving import Direct
from gateway.routes.openai.wire import ChatIn, CompletionsIn
from runtime.redisio import REDIS_DOWN

logger = logging.getLogger(__name__)

_REFUSED_HEADERS = frozenset({b"origin", b"expect", b"transfer-encoding", b"upgrade"})
"""Headers that take a request to the ASGI app: CORS, ``100-continue``, a chunked body,
an upgrade."""


_POST = {"method": "POST"}
"""What the edge's record reads of a taken call's scope (its label is never ``other``)."""


@dataclass(frozen=True, slots=True)
class Taken:
    """A call the protocol answers itself: its route, path and headers as read, and who
    the edge's key check names (a job's owner)."""

    route: Route
    path: str
    sent: Sent
    started: float
    principal: str = ANONYMOUS


class DirectCalls:
    """The calls a gateway answers on the connection (module doc).

    Args:
        edge: the app's edge (keys, body limit, metrics, access line).
        calls: the app's hot path (its routes, gateway and error mapping).
    """

    def __init__(self, edge: EdgeMiddleware, calls: SyncCalls) -> None:
        self.edge, self.calls, self.gateway = edge, calls, calls.gateway
        self.answered = 0  # calls answered here
        self.routes = {path.encode(): route for path, route in calls.routes.items()}

    def take(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]]) -> Taken | None:
        """The call, where its head is one this path answers as the app would; else None."""
        route = self.routes.get(url) if method == b"POST" else None
        if route is None:
            return None
        length = None
        for name, value in headers:
            if name in _REFUSED_HEADERS:
                return None
            if name == b"content-length":
                if length is not None or not value.isdigit():
                    return None
                length = int(value)
        if length is None or length > self.edge.max_body_bytes:
            return None
        path = url.decode("latin-1")
        principal = ANONYMOUS
        if self.edge.api_keys:
            scope = {"headers": headers, "path": path, "method": "POST"}
            who = self.edge._authenticate(scope)
            if who is None:
                return None  # the edge's 401
            principal = who
        sent = plain_headers(headers, "job" if isinstance(route, Job) else "call")
        if sent is None:
            return None
        return Taken(route, path, sent, time.perf_counter(), principal)

    def validated(self, taken: Taken, body: bytes) -> Any:
        """The call's input as its route would hand it on (an OpenAI route's body read
        with the pipeline its ``model`` names); None where the route should answer: it
        refuses the body (FastAPI's own 422, OpenAI's 400 or 404), or the input model's
        validator raised what is no exception (the edge answers 500, as for any other
        call); :data:`~gateway.protocol.APP` for a completion asked to stream (the app's
        hot path streams it)."""
        try:
            read = self.calls.read(taken.route, body)
        except BaseException:  # a user's validator, in the parser's callback: not here
            return None
        asked = None if read is None or not isinstance(taken.route, Direct) else read[0]
        if isinstance(asked, (CompletionsIn, ChatIn)) and asked.stream:
            return APP  # written as it comes: the app's (its hot path's)
        return read

    async def answer(self, taken: Taken, payload: Any, disconnect: Disconnect) -> Response:
        """The call's response, as the hot path gives it (its errors the route's)."""
        self.answered += 1
        self.calls.answered += 1
        # What the hot path reads of a call's scope: its owner, as the edge names it, and
        # its client's Disconnect (the body is read: _never is never called).
        scope = {"state": {"principal": taken.principal}, DISCONNECT: disconnect}
        try:
            return await self.calls.answer(taken.route, payload, taken.sent, scope, _never)
        except REDIS_DOWN as exc:  # as the app's handler answers it
            return self.calls.error_response(refusal(exc))
        except Exception:
            logger.exception("unhandled error on %s", taken.path)
            return json_response({"detail": "internal error"}, 500)
        except asyncio.CancelledError:
            raise  # the server's own (a shutdown past its grace)
        except BaseException as exc:
            # Raised by a user's code run per request: one request fails, never the
            # gateway (past this, asyncio would stop it), as at the edge.
            logger.error("%s raised on %s; answered 500", type(exc).__name__, taken.path)
            return json_response({"detail": "internal error"}, 500)

    def observe(self, taken: Taken, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The answered call's metrics and access line, as the edge records them (under
        its path, as it labels a call the hot path answered)."""
        seconds = time.perf_counter() - taken.started
        self.edge.record(_POST, taken.path, status, seconds, headers)


async def _never() -> dict[str, Any]:
    """An ASGI receive that is never called: a call taken here learns of its client going
    away from its connection (:class:`~gateway.protocol.Disconnect`)."""
    raise RuntimeError("a direct call's body is read by the protocol")


def direct_calls(stack: Any) -> DirectCalls | None:
    """The calls answerable on the connection for an app whose middleware ``stack``
    (FastAPI's, under :class:`~gateway.app.GatewayApp`'s direct path) holds the edge and
    the hot path; None when it does not (another stack: every call goes through it)."""
    edge = calls = None
    layer = stack
    for _ in range(32):  # a stack is a few layers deep
        if isinstance(layer, EdgeMiddleware):
            edge = layer
        elif isinstance(layer, SyncCalls):
            calls = layer
        layer = getattr(layer, "app", None)
        if layer is None:
            break
    if edge is None or calls is None:
        return None
    return DirectCalls(edge, calls)
