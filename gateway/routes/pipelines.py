"""Each pipeline's routes: ``POST /v1/{name}`` (the body), ``GET /v1/{name}?field=`` (when
one string field is all the input needs) and ``POST /v1/{name}/stream`` (Server-Sent
Events, for a one-step pipeline whose stage streams)."""

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import orjson
from fastapi import Body, FastAPI, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from gateway.headers import Sent, parameters, sent_on
from gateway.protocol import DISCONNECT
from gateway.responses import answer, declared, validation_issues
from gateway.routes import BODY_ERRORS, json_response
from gateway.service import Gateway
from pipelines.envelope import Reply, new_request_id
from pipelines.errors import Cancelled, DeadlineExceeded, ItemFailed
from pipelines.graph import Pipeline
from pipelines.outcomes import Outcome

RESULT_ERRORS = (404, 500, 502, 503, 504)  # what a step, the queue or a bad reply can answer


def add_pipeline_routes(app: FastAPI, gw: Gateway, edge: list[int]) -> None:
    """Route every pipeline of ``gw``'s registry.

    Args:
        app: the application to add the routes to.
        gw: the gateway that enqueues the requests and awaits their replies.
        edge: the statuses the edge can answer first (413, and 401 with API keys on).
    """
    for pipeline in gw.registry.pipelines.values():
        _add_routes(app, gw, pipeline, edge)


def reply_response(reply: Reply, request_id: str) -> Response:
    """The HTTP response for a request's final reply (errors raise, mapped in one place)."""
    if reply.outcome is Outcome.OK:
        return json_response(reply.result, Outcome.OK.http_status, {"X-Request-Id": request_id})
    if reply.outcome is Outcome.EXPIRED:
        raise DeadlineExceeded("deadline passed before the request finished", request_id=request_id)
    if reply.outcome is Outcome.CANCELLED:
        raise Cancelled(f"step {reply.stage!r}: cancelled", request_id=request_id)
    raise ItemFailed(
        f"step {reply.stage!r} failed: {reply.error}",
        status=reply.http_status,
        request_id=request_id,
        retry_after=reply.retry_after,
    )


def query_field(model: type[BaseModel]) -> str | None:
    """The one required string field a GET query can fill, if the model has exactly one."""
    required = [(n, f) for n, f in model.model_fields.items() if f.is_required()]
    if len(required) == 1 and required[0][1].annotation is str:
        return required[0][0]
    return None


def _add_routes(app: FastAPI, gw: Gateway, pipeline: Pipeline, edge: list[int]) -> None:
    async def run(http: Request, payload: BaseModel, sent: Sent) -> Response:
        data = payload.model_dump(mode="json")
        # The body is read: what receive says next is the client going away.
        disconnect = http.scope.get(DISCONNECT)
        request_id, reply = await gw.call(pipeline, data, sent, http.receive, disconnect)
        return reply_response(reply, request_id)

    async def post(
        http: Request, payload: BaseModel, sent: Annotated[Sent, sent_on("call")]
    ) -> Response:
        return await run(http, payload, sent)

    # FastAPI reads the body model from the annotation; each pipeline has its own.
    post.__annotations__["payload"] = Annotated[pipeline.input_model, Body()]
    path = f"/v1/{pipeline.name}"
    summary = pipeline.summary or pipeline.name
    app.add_api_route(
        path,
        post,
        methods=["POST"],
        summary=summary,
        tags=["pipelines"],
        name=f"post_{pipeline.name}",
        responses={
            **answer(pipeline.output_model),
            **declared([*edge, *BODY_ERRORS, *RESULT_ERRORS]),
        },
    )
    if len(pipeline.steps) == 1 and pipeline.entry.stage.streaming:
        _add_stream_route(app, gw, pipeline, edge)
    field = query_field(pipeline.input_model)
    if field is None:
        return

    async def get(**kwargs: Any) -> Response:
        try:
            payload = pipeline.input_model.model_validate({field: kwargs[field]})
        except ValidationError as exc:
            issues = [{**e, "loc": ("query", *e["loc"])} for e in exc.errors()]
            return json_response({"detail": validation_issues(issues)}, 422)
        return await run(kwargs["_request"], payload, Sent.of("call", kwargs))

    # The query parameter is named after the model's field (``text``, ``search_term``).
    kw = inspect.Parameter.KEYWORD_ONLY
    get.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter("_request", kw, annotation=Request),  # a field never starts so
            inspect.Parameter(field, kw, annotation=Annotated[str, Query(min_length=1)]),
            *parameters(),
        ]
    )
    app.add_api_route(
        path,
        get,
        methods=["GET"],
        summary=f"{summary} (?{field}=)",
        tags=["pipelines"],
        name=f"get_{pipeline.name}",
        responses={**answer(pipeline.output_model), **declared([*edge, 422, *RESULT_ERRORS])},
    )


class EventStream(StreamingResponse):
    """Server-Sent Events (declares ``text/event-stream`` in the OpenAPI document).

    Args:
        content: the events.
        status_code: the response's status.
        headers: the response's headers.
        ended: called once the response is over, however it ended: the client gone
            included, and before the first event was read.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        status_code: int = 200,  # FastAPI reads the route's status from this default
        headers: dict[str, str] | None = None,
        *,
        ended: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(content, status_code, headers)
        self.ended = ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # On a disconnect, Starlette stops reading the events (the task reading them
            # is cancelled) and returns.
            await super().__call__(scope, receive, send)
        finally:
            if self.ended is not None:
                self.ended()


def _add_stream_route(app: FastAPI, gw: Gateway, pipeline: Pipeline, edge: list[int]) -> None:
    async def stream(payload: BaseModel, sent: Annotated[Sent, sent_on("stream")]) -> Response:
        request_id, relay, ended = await open_stream(
            gw, pipeline, payload.model_dump(mode="json"), sent
        )
        headers = {"X-Request-Id": request_id, "Cache-Control": "no-cache"}
        return EventStream(relay.events(), headers=headers, ended=ended)

    stream.__annotations__["payload"] = Annotated[pipeline.input_model, Body()]
    app.add_api_route(
        f"/v1/{pipeline.name}/stream",
        stream,
        methods=["POST"],
        tags=["pipelines"],
        summary=f"{pipeline.summary or pipeline.name} (Server-Sent Events)",
        name=f"stream_{pipeline.name}",
        response_class=EventStream,
        responses=declared([*edge, *BODY_ERRORS, 503]),  # later errors are `error` events
    )


async def open_stream(
    gw: Gateway, pipeline: Pipeline, payload: dict[str, Any], sent: Sent
) -> tuple[str, "Relay", Callable[[], None]]:
    """Enqueue a streamed request and relay its replies.

    Args:
        gw: the gateway.
        pipeline: the one-step pipeline whose stage streams.
        payload: the validated request.
        sent: its headers.

    Returns:
        Its request id, the relay of its replies, and what to call once the response
        is over however it ended (a client gone first gets its request cancelled).

    Raises:
        ConveyorError: refused before anything streams (503 and the like).
    """
    request_id = new_request_id()
    queue = gw.replies.expect_stream(request_id)
    try:
        # Refusals (503) happen here, before the stream starts, as plain HTTP errors.
        request = await gw.enqueue(pipeline, payload, sent, request_id=request_id, stream=True)
    except BaseException:
        gw.replies.forget(request_id)
        raise
    relay = Relay(queue, gw.timeout_for(sent.timeout_s))

    def ended() -> None:
        gw.replies.forget(request_id)
        if not relay.finished:  # the client went away first: nobody reads the rest
            gw.cancellations.mark_soon(request_id, request.deadline)

    return request_id, relay, ended


def _sse(event: str, data: Any) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _without_offset(reply: Reply, result: dict[str, Any], text: str) -> Reply:
    """``reply`` with ``text``, without its offset: that is between worker and gateway."""
    kept = {k: v for k, v in result.items() if k != "at"}
    return reply.model_copy(update={"result": {**kept, "text": text}})


class Relay:
    """A streamed request's replies, read until the last: :meth:`events` as conveyor's
    events, or :meth:`replies` for a route of another shape (the OpenAI routes);
    ``finished`` once the last is read.

    Args:
        queue: where its replies arrive (:meth:`ReplyDispatcher.expect_stream
            <gateway.replies.ReplyDispatcher.expect_stream>`).
        budget: seconds the whole stream may take.
    """

    def __init__(self, queue: asyncio.Queue[Reply], budget: float) -> None:
        self.queue, self.budget = queue, budget
        self.finished = False
        self.sent: dict[str, int] = {}  # characters streamed so far, by the stage's

    def _new_part(self, reply: Reply) -> Reply | None:
        """What of a partial reply the client has not seen: a worker that took the
        request over (its first one died) streams again from the start, each partial
        saying where its text starts (``at``); None when it is all old. Each stage of a
        pipeline streams its own text, so each has its own count."""
        result = reply.result if isinstance(reply.result, dict) else {}
        text, at = result.get("text"), result.get("at")
        if not isinstance(text, str):
            return reply
        sent = self.sent.get(reply.stage, 0)
        if isinstance(at, bool) or not isinstance(at, int) or at < 0:
            # No offset (an older worker): passed on as it is, its text counted.
            self.sent[reply.stage] = sent + len(text)
            return _without_offset(reply, result, text)
        if at > sent:
            # Past what was sent (a partial lost on its way, or forged): passed on whole,
            # and the count stays: only text that follows on from what was sent moves
            # it, so nothing later is taken for seen.
            return _without_offset(reply, result, text)
        seen = sent - at
        if seen >= len(text):
            return None
        self.sent[reply.stage] = at + len(text)
        return _without_offset(reply, result, text[seen:])

    async def replies(self) -> AsyncIterator[Reply | None]:
        """Each reply as it arrives (``partial`` ones, then the final one), or None, the
        last, where the budget ran out first."""
        deadline = time.monotonic() + self.budget
        while True:
            try:
                reply = await asyncio.wait_for(self.queue.get(), deadline - time.monotonic())
            except TimeoutError:
                self.finished = True
                yield None
                return
            if reply.outcome == "partial":
                fresh = self._new_part(reply)
                if fresh is not None:
                    yield fresh
                continue
            self.finished = True
            yield reply
            return

    async def events(self) -> AsyncIterator[bytes]:
        """``token`` as text arrives, then ``done`` (the result) or ``error``."""
        async for reply in self.replies():
            if reply is None:
                yield _sse("error", {"detail": f"no result within {self.budget:g}s", "status": 504})
            elif reply.outcome == "partial":
                yield _sse("token", reply.result)
            elif reply.outcome is Outcome.OK:
                yield _sse("done", reply.result)
            else:
                yield _sse("error", {"detail": reply.error, "status": reply.http_status})
