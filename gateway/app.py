"""The FastAPI application: stage routes, health, metrics, and error mapping."""

import asyncio
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import orjson
from fastapi import Body, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError, WithJsonSchema

from gateway.body import WireRoute
from gateway.edge import OPEN_PATHS, EdgeMiddleware, principal
from gateway.responses import (
    JobAccepted,
    JobView,
    Readiness,
    declared,
    openapi_document,
    validation_issues,
)
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from gateway.status import status_router
from pipelines.envelope import Reply, new_request_id
from pipelines.errors import (
    RETRY_AFTER_MAX_S,
    ConveyorError,
    DeadlineExceeded,
    InvalidInput,
    ItemFailed,
)
from pipelines.graph import Pipeline
from pipelines.redisio import REDIS_DOWN, refusal
from pipelines.registry import Registry, load_registry
from pipelines.stats import render_stage_metrics

logger = logging.getLogger(__name__)

TIMEOUT_HEADER = "X-Conveyor-Timeout"
TRACE_HEADER = "X-Trace-Id"


def _json(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content), status, headers, media_type="application/json")


def error_response(exc: ConveyorError) -> Response:
    """The HTTP response for a conveyor error: status, message, request id, Retry-After."""
    status = exc.status
    headers: dict[str, str] = {}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        # Bounded whatever a step or an upstream said (an hour at most; a day of digits,
        # or infinity, would reach the client as nonsense or as no header at all).
        wait = retry_after if math.isfinite(retry_after) else RETRY_AFTER_MAX_S
        headers["Retry-After"] = str(max(1, min(round(wait), RETRY_AFTER_MAX_S)))
    body: dict[str, Any] = {"detail": str(exc)}
    if status == 422:  # one 422 shape, whoever refuses: a list of {loc, msg, type}
        issues = exc.problems if isinstance(exc, InvalidInput) else None
        body["detail"] = validation_issues(issues) if issues else [
            {"loc": ["body"], "msg": str(exc), "type": "value_error"}]  # fmt: skip
    if exc.request_id:
        body["request_id"] = exc.request_id
        headers["X-Request-Id"] = exc.request_id
    return _json(body, status, headers)


def create_app(
    settings: GatewaySettings | None = None, registry: Registry | None = None
) -> FastAPI:
    """Build the gateway application.

    Args:
        settings: gateway settings (default: from the environment).
        registry: pipelines to route (default: ``settings.app`` / ``settings.pipelines``,
            or the built-ins).
    """
    settings = settings or GatewaySettings()
    registry = registry or load_registry(settings.app, settings.pipelines)
    gw = Gateway(settings, registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(
        title="conveyor",
        summary="ML models served behind Redis Streams, batched.",
        lifespan=lifespan,
    )
    app.state.gateway = gw
    app.router.route_class = WireRoute  # bodies parsed as the envelope will carry them
    edge = [413, 401] if settings.api_keys else [413]  # the edge answers these first
    app.openapi = lambda: openapi_document(app, bool(settings.api_keys), OPEN_PATHS)  # type: ignore[method-assign]

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return _json({"detail": validation_issues(exc.errors())}, 422)

    @app.exception_handler(ConveyorError)
    async def _conveyor_error(request: Request, exc: ConveyorError) -> Response:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        if isinstance(exc, REDIS_DOWN):
            return error_response(refusal(exc))
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        return _json({"detail": "internal error"}, 500)

    @app.get("/healthz", tags=["ops"], responses=declared([413]))
    async def healthz() -> dict[str, str]:
        """The process is up."""
        return {"status": "ok"}

    not_ready: dict[int | str, dict[str, Any]] = {
        503: {"model": Readiness, "description": "Redis does not answer."}
    }

    @app.get("/readyz", tags=["ops"], response_model=Readiness,
             responses={**declared([413]), **not_ready})  # fmt: skip
    async def readyz() -> Response:
        """Ready to accept work: Redis answers."""
        if await gw.ready():
            return _json({"status": "ready"})
        return _json({"status": "redis unreachable"}, 503, {"Retry-After": "1"})

    @app.get("/v1/jobs/{job_id}", tags=["jobs"], response_model=JobView,
             responses=declared([*edge, 404, 422, 503]))  # fmt: skip
    async def job(request: Request, job_id: Annotated[str, Path(max_length=128)]) -> Response:
        """An async job: ``queued``, or ``done`` with the result the sync call returns, or
        ``failed`` / ``expired`` with the error. Only the API key that submitted it (or,
        with keys off, no key) can read it; to any other it is 404, like an unknown id."""
        return _json(await gw.job(job_id, principal(request.scope)))

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse,
             responses=declared(edge))  # fmt: skip
    async def metrics() -> PlainTextResponse:
        """Prometheus text: this gateway's requests and every routed stage's stats."""
        text = gw.metrics.render()
        try:
            text += await render_stage_metrics(gw.client, gw.keys, gw.registry.stages)
        except REDIS_DOWN:
            text += "# stage metrics unavailable: redis unreachable\n"
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    app.include_router(status_router(gw), responses=declared([*edge, 503]))
    for pipeline in registry.pipelines.values():
        _add_pipeline_routes(app, gw, pipeline, edge)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=[
                "Authorization",
                "Content-Type",
                "X-API-Key",
                TIMEOUT_HEADER,
                TRACE_HEADER,
            ],
        )
    app.add_middleware(  # added last: outermost, so refusals happen before anything else
        EdgeMiddleware,
        max_body_bytes=settings.max_body_bytes,
        metrics=gw.metrics,
        routes=[f"/v1/{name}" for name in registry.pipelines],
        api_keys=settings.api_keys,
        client_timeout_s=settings.client_timeout_s,
    )
    return app


# Absent, or a finite number > 0: the schema says exactly that (a header is never null).
Timeout = Annotated[
    float | None,
    Header(alias=TIMEOUT_HEADER, gt=0, allow_inf_nan=False,
           description="Deadline in seconds (capped at CONVEYOR_MAX_TIMEOUT_S)."),
    WithJsonSchema({"type": "number", "exclusiveMinimum": 0}),
]  # fmt: skip
Trace = Annotated[
    str | None,
    Header(alias=TRACE_HEADER, max_length=128),
    WithJsonSchema({"type": "string", "maxLength": 128}),
]
BODY_ERRORS = (408, 422)  # too slow, invalid (an undecodable body is a 422: gateway/body.py)
RESULT_ERRORS = (404, 500, 503, 504)  # what a step or the queue can answer instead


def reply_response(reply: Reply, request_id: str) -> Response:
    """The HTTP response for a request's final reply (errors raise, mapped in one place)."""
    if reply.outcome == "ok":
        return _json(reply.result, 200, {"X-Request-Id": request_id})
    if reply.outcome == "expired":
        raise DeadlineExceeded("deadline passed before the request finished", request_id=request_id)
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


def _add_pipeline_routes(app: FastAPI, gw: Gateway, pipeline: Pipeline, edge: list[int]) -> None:
    async def run(payload: BaseModel, asked: float | None, trace: str | None) -> Response:
        data = payload.model_dump(mode="json")
        request_id, reply = await gw.call(pipeline, data, gw.timeout_for(asked), trace)
        return reply_response(reply, request_id)

    async def post(payload: BaseModel, timeout_s: Timeout = None, trace: Trace = None) -> Response:
        return await run(payload, timeout_s, trace)

    # FastAPI reads the body model from the annotation; each pipeline has its own.
    post.__annotations__["payload"] = Annotated[pipeline.input_model, Body()]
    path = f"/v1/{pipeline.name}"
    summary = pipeline.summary or pipeline.name
    app.add_api_route(path, post, methods=["POST"], summary=summary, tags=["pipelines"],
                      name=f"post_{pipeline.name}",
                      responses=declared([*edge, *BODY_ERRORS, *RESULT_ERRORS]))  # fmt: skip
    _add_job_route(app, gw, pipeline, edge)
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
            return _json({"detail": validation_issues(issues)}, 422)
        return await run(payload, kwargs["timeout_s"], kwargs["trace"])

    # The query parameter is named after the model's field (``text``, ``search_term``).
    kw = inspect.Parameter.KEYWORD_ONLY
    get.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(field, kw, annotation=Annotated[str, Query(min_length=1)]),
            inspect.Parameter("timeout_s", kw, default=None, annotation=Timeout),
            inspect.Parameter("trace", kw, default=None, annotation=Trace),
        ]
    )
    app.add_api_route(path, get, methods=["GET"], summary=f"{summary} (?{field}=)",
                      tags=["pipelines"], name=f"get_{pipeline.name}",
                      responses=declared([*edge, 422, *RESULT_ERRORS]))  # fmt: skip


def _add_job_route(app: FastAPI, gw: Gateway, pipeline: Pipeline, edge: list[int]) -> None:
    async def submit(
        http: Request, payload: BaseModel, timeout_s: Timeout = None, trace: Trace = None
    ) -> Response:
        data = payload.model_dump(mode="json")
        budget = gw.timeout_for(timeout_s, job=True)
        owner = principal(http.scope)
        request = await gw.enqueue(pipeline, data, budget, trace, job=True, owner=owner)
        location = f"/v1/jobs/{request.id}"
        body = {"id": request.id, "status": "queued", "url": location}
        return _json(body, 202, {"Location": location, "X-Request-Id": request.id})

    submit.__annotations__["payload"] = Annotated[pipeline.input_model, Body()]
    app.add_api_route(
        f"/v1/jobs/{pipeline.name}", submit, methods=["POST"], status_code=202, tags=["jobs"],
        summary=f"Submit an async {pipeline.name} job", name=f"job_{pipeline.name}",
        response_model=JobAccepted, responses=declared([*edge, *BODY_ERRORS, 503]),
    )  # fmt: skip


class EventStream(StreamingResponse):
    """Server-Sent Events (declares ``text/event-stream`` in the OpenAPI document)."""

    media_type = "text/event-stream"


def _add_stream_route(app: FastAPI, gw: Gateway, pipeline: Pipeline, edge: list[int]) -> None:
    async def stream(
        payload: BaseModel, timeout_s: Timeout = None, trace: Trace = None
    ) -> Response:
        budget = gw.timeout_for(timeout_s)
        request_id = new_request_id()
        queue = gw.replies.expect_stream(request_id)
        try:
            # Refusals (503) happen here, before the stream starts, as plain HTTP errors.
            await gw.enqueue(pipeline, payload.model_dump(mode="json"), budget, trace,
                             request_id=request_id, stream=True)  # fmt: skip
        except BaseException:
            gw.replies.forget(request_id)
            raise
        events = _sse_events(gw, queue, request_id, budget)
        headers = {"X-Request-Id": request_id, "Cache-Control": "no-cache"}
        return EventStream(events, headers=headers)

    stream.__annotations__["payload"] = Annotated[pipeline.input_model, Body()]
    app.add_api_route(
        f"/v1/{pipeline.name}/stream", stream, methods=["POST"], tags=["pipelines"],
        summary=f"{pipeline.summary or pipeline.name} (Server-Sent Events)",
        name=f"stream_{pipeline.name}", response_class=EventStream,
        responses=declared([*edge, *BODY_ERRORS, 503]),  # later errors are `error` events
    )  # fmt: skip


def _sse(event: str, data: Any) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


async def _sse_events(
    gw: Gateway, queue: asyncio.Queue[Reply], request_id: str, budget: float
) -> AsyncIterator[bytes]:
    """``token`` events as text arrives, then ``done`` (the result) or ``error``."""
    deadline = time.monotonic() + budget
    try:
        while True:
            try:
                reply = await asyncio.wait_for(queue.get(), deadline - time.monotonic())
            except TimeoutError:
                yield _sse("error", {"detail": f"no result within {budget:g}s", "status": 504})
                return
            if reply.outcome == "partial":
                yield _sse("token", reply.result)
            elif reply.outcome == "ok":
                yield _sse("done", reply.result)
                return
            else:
                yield _sse("error", {"detail": reply.error, "status": reply.http_status})
                return
    finally:
        gw.replies.forget(request_id)
