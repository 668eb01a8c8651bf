"""The hot path: ``POST /v1/{pipeline}``, a job's submission (``POST
/v1/jobs/{pipeline}``) and the OpenAI-compatible POST routes (``/v1/embeddings``,
``/v1/completions``, ``/v1/chat/completions``) answered without FastAPI's per-request
machinery.

FastAPI resolves a route's dependencies, headers and body anew for every request; on a
small, fast model that costs more CPU than the rest of the gateway together (on the
OpenAI embeddings route, half the requests a second of a fast stage). This middleware,
inside the edge (keys, body limit, metrics) and CORS, takes a call whose request is
unremarkable, the common case, and does what the FastAPI route would do with it: parse
the body as :mod:`gateway.body` does, validate it with the pipeline's input model (an
OpenAI route's body model, its ``model`` found), read the request headers
(:mod:`gateway.headers`, with the route's defaults: a job's lane is bulk), call
:meth:`Gateway.call <gateway.service.Gateway.call>` (a job's route's own answer,
:func:`~gateway.routes.jobs.submit_job`; an OpenAI route's,
:class:`~gateway.routes.openai.serving.Direct`) and answer as the route does, its errors
in the route's shape.

Anything it is not sure of goes to the FastAPI route with what was read of its body
replayed, so every refusal is FastAPI's own (the same 422 or OpenAI 400, the same loc,
the same OpenAPI document): a header that is not plainly valid or appears twice, a
content type other than JSON, a body that is empty, not JSON, holds what the wire cannot
carry, or fails validation, an unknown ``model``, a client gone while its body was read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.body import parse_body
from gateway.headers import HEADERS, UNCLEAR, RouteKind, Sent
from gateway.protocol import DISCONNECT, REPLAYED
from gateway.routes.jobs import submission_path, submit_job
from gateway.routes.openai.errors import error_of, http_error
from gateway.routes.openai.serving import Direct
from gateway.routes.pipelines import reply_response
from gateway.service import Gateway
from gateway.traces import answered_as
from pipelines.errors import ConveyorError
from pipelines.graph import Pipeline

_CONTENT_TYPE = b"content-type"
_READ = {h.key: h for h in HEADERS}
_WATCHED = frozenset({*_READ, _CONTENT_TYPE})
_JSON = frozenset({b"application/json", b"application/json; charset=utf-8"})
# None of them sent, the common case (frozen values), per kind of route taken.
_NONE_SENT: dict[RouteKind, Sent] = {kind: Sent.of(kind, {}) for kind in ("call", "job")}


@dataclass(frozen=True)
class Job:
    """A pipeline's job submission route (``POST /v1/jobs/{name}``)."""

    pipeline: Pipeline


Route = Pipeline | Job | Direct[Any]
"""A route the hot path answers: a pipeline's call, its job's submission, an OpenAI one."""


def plain_headers(headers: list[tuple[bytes, bytes]], kind: RouteKind = "call") -> Sent | None:
    """The request's headers as a ``kind`` of route reads them (each declared header's
    own parser, :mod:`gateway.headers`, and the route's defaults), or None where the route
    should decide: one of them is sent twice or holds anything but a plainly valid value,
    or the body is not declared JSON."""
    seen: dict[bytes, bytes] = {}
    for name, value in headers:
        if name in _WATCHED:
            if name in seen:
                return None
            seen[name] = value
    if seen.pop(_CONTENT_TYPE, b"").lower() not in _JSON:
        return None
    if not seen:
        return _NONE_SENT[kind]
    values: dict[str, Any] = {}
    for key, raw in seen.items():
        header = _READ[key]
        value = header.parse(raw)
        if value is UNCLEAR:
            return None
        values[header.param] = value
    return Sent.of(kind, values)


def replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives ``messages`` first, then what ``receive`` gives."""
    pending = list(messages)

    async def again() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return again


class SyncCalls:
    """ASGI middleware answering plain ``POST /v1/{pipeline}`` calls, job submissions and
    OpenAI-compatible POSTs itself (module doc).

    Args:
        app: the application (the FastAPI routes), which answers everything else.
        gateway: the gateway that enqueues the requests and awaits their replies.
        error_response: the HTTP answer for a conveyor error (the one mapping).
        openai: the OpenAI-compatible POST routes, by path (none: left to FastAPI).

    Attributes:
        answered: calls it answered itself (the rest went to the route).
    """

    def __init__(
        self,
        app: ASGIApp,
        gateway: Gateway,
        error_response: Callable[[ConveyorError], Response],
        openai: Mapping[str, Direct[Any]] | None = None,
    ) -> None:
        self.app = app
        self.gateway = gateway
        self.error_response = error_response
        pipelines = gateway.registry.pipelines.items()
        self.routes: dict[str, Route] = {f"/v1/{name}": p for name, p in pipelines}
        self.routes.update({submission_path(name): Job(p) for name, p in pipelines})
        self.routes.update(openai or {})  # no pipeline takes their names (RESERVED)
        self.answered = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if (
            route is None
            or scope["method"] != "POST"
            or scope.get("root_path")
            or REPLAYED in scope
        ):
            await self.app(scope, receive, send)
            return
        sent = plain_headers(scope["headers"], "job" if isinstance(route, Job) else "call")
        if sent is None:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        chunks: list[bytes] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # gone (or refused by the edge)
                await self.app(scope, replay(messages, receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        response = await self._respond(route, b"".join(chunks), sent, scope, receive)
        if response is None:
            await self.app(scope, replay(messages, receive), send)
        else:
            self.answered += 1
            await response(scope, receive, send)  # a stream is admitted here

    async def _respond(
        self, route: Route, raw: bytes, sent: Sent, scope: Scope, receive: Receive
    ) -> Response | None:
        """The call's answer, as its route would give it; None where the route should
        answer it."""
        read = self.read(route, raw)
        if read is None:
            return None
        answered_as(scope, scope["path"])  # its trace named as the route would name it
        return await self.answer(route, read, sent, scope, receive)

    def read(self, route: Route, raw: bytes) -> Any:
        """The body as ``route`` would hand it on (an OpenAI route's read with the
        pipeline its ``model`` names); None where the route refuses it."""
        if isinstance(route, Direct):
            value = parsed(raw)
            return None if value is None else route.read(value)
        return self._validated(route.pipeline if isinstance(route, Job) else route, raw)

    async def answer(
        self, route: Route, read: Any, sent: Sent, scope: Scope, receive: Receive
    ) -> Response:
        """The answer to a call whose body ``route`` took (:meth:`read`), its refusals in
        the route's shape (OpenAI's on its routes). ``scope`` gives the caller the edge
        named (a job's owner) and the client's :class:`~gateway.protocol.Disconnect`;
        ``receive`` is what the client says once the body is read (it going away).

        Raises:
            HTTPException: on a pipeline's or a job's route (the app's handler answers it).
        """
        disconnect = scope.get(DISCONNECT)
        try:
            if isinstance(route, Direct):
                body, pipeline = read
                return await route(body, pipeline, sent, receive, disconnect)
            if isinstance(route, Job):
                return await submit_job(self.gateway, route.pipeline, read, sent, scope)
            request_id, reply = await self.gateway.call(route, read, sent, receive, disconnect)
            return reply_response(reply, request_id)
        except ConveyorError as exc:
            response = self.error_response(exc)
            return error_of(exc, response) if isinstance(route, Direct) else response
        except HTTPException as exc:  # as the app's handler answers it on these routes
            if not isinstance(route, Direct):
                raise
            return http_error(exc)

    @staticmethod
    def _validated(pipeline: Pipeline, raw: bytes) -> dict[str, Any] | None:
        """The body as the route would hand it on, or None where the route refuses it."""
        value = parsed(raw)
        if value is None:
            return None
        try:
            return pipeline.input_model.model_validate(value).model_dump(mode="json")
        except Exception:  # not valid (or anything else): the route's to answer
            return None


def parsed(raw: bytes) -> Any:
    """The body's JSON value as :mod:`gateway.body` reads it; None where the route should
    meet it: empty, not JSON, not carried by the wire (or anything else)."""
    if not raw:
        return None
    try:
        return parse_body(raw)
    except Exception:
        return None
