"""The FastAPI application: stage routes, health, metrics, and error mapping."""

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import orjson
from fastapi import Body, FastAPI, Header, Query, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from gateway.edge import EdgeMiddleware
from gateway.service import REDIS_DOWN, Gateway
from gateway.settings import GatewaySettings
from pipelines.errors import (
    ConveyorError,
    DeadlineExceeded,
    ItemFailed,
    Overloaded,
    Unavailable,
)
from pipelines.stages import Stage, parse_stage_list
from pipelines.stats import render_stage_metrics

logger = logging.getLogger(__name__)

TIMEOUT_HEADER = "X-Conveyor-Timeout"
TRACE_HEADER = "X-Trace-Id"

# One place maps errors to statuses.
_STATUS: list[tuple[type[ConveyorError], int]] = [
    (Overloaded, 503),
    (Unavailable, 503),
    (DeadlineExceeded, 504),
    (ItemFailed, 500),
]


def _json(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content), status, headers, media_type="application/json")


def error_response(exc: ConveyorError) -> Response:
    """The HTTP response for a conveyor error: status, message, request id, Retry-After."""
    status = next((code for cls, code in _STATUS if isinstance(exc, cls)), 500)
    headers: dict[str, str] = {}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, round(retry_after)))
    body: dict[str, Any] = {"detail": str(exc)}
    if exc.request_id:
        body["request_id"] = exc.request_id
        headers["X-Request-Id"] = exc.request_id
    return _json(body, status, headers)


def create_app(
    settings: GatewaySettings | None = None, stages: list[Stage] | None = None
) -> FastAPI:
    """Build the gateway application.

    Args:
        settings: gateway settings (default: from the environment).
        stages: stages to route (default: ``settings.pipelines`` or the built-ins).
    """
    settings = settings or GatewaySettings()
    chosen = stages if stages is not None else parse_stage_list(settings.pipelines)
    gw = Gateway(settings, {s.name: s for s in chosen})

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

    @app.exception_handler(ConveyorError)
    async def _conveyor_error(request: Request, exc: ConveyorError) -> Response:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        if isinstance(exc, REDIS_DOWN):
            return error_response(Unavailable("the queue is unreachable; retry shortly"))
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        return _json({"detail": "internal error"}, 500)

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        """The process is up."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    async def readyz() -> Response:
        """Ready to accept work: Redis answers."""
        if await gw.ready():
            return _json({"status": "ready"})
        return _json({"status": "redis unreachable"}, 503, {"Retry-After": "1"})

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        """Prometheus text: this gateway's requests and every routed stage's stats."""
        text = gw.metrics.render()
        try:
            text += await render_stage_metrics(gw.client, gw.keys, gw.stages)
        except REDIS_DOWN:
            text += "# stage metrics unavailable: redis unreachable\n"
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    for stage in chosen:
        _add_stage_routes(app, gw, stage)
    app.add_middleware(
        EdgeMiddleware,
        max_body_bytes=settings.max_body_bytes,
        metrics=gw.metrics,
        routes=[f"/v1/{s.name}" for s in chosen],
    )
    return app


def _add_stage_routes(app: FastAPI, gw: Gateway, stage: Stage) -> None:
    async def run(payload: dict[str, Any], asked: float | None, trace: str | None) -> Response:
        request_id, reply = await gw.call(stage, payload, gw.timeout_for(asked), trace)
        if reply.outcome == "ok":
            return _json(reply.result, 200, {"X-Request-Id": request_id})
        if reply.outcome == "expired":
            raise DeadlineExceeded("deadline passed before the model ran", request_id=request_id)
        raise ItemFailed(f"stage {stage.name!r} failed: {reply.error}", request_id=request_id)

    Timeout = Annotated[
        float | None,
        Header(alias=TIMEOUT_HEADER, gt=0, description="Deadline in seconds (capped)."),
    ]
    Trace = Annotated[str | None, Header(alias=TRACE_HEADER, max_length=128)]

    async def post(payload: BaseModel, timeout_s: Timeout = None, trace: Trace = None) -> Response:
        return await run(payload.model_dump(mode="json"), timeout_s, trace)

    # FastAPI reads the body model from the annotation; each stage has its own.
    post.__annotations__["payload"] = Annotated[stage.input_model, Body()]
    app.add_api_route(
        f"/v1/{stage.name}",
        post,
        methods=["POST"],
        summary=stage.summary or stage.name,
        tags=["models"],
        name=f"post_{stage.name}",
    )
    if not stage.single_text:
        return

    async def get(
        text: Annotated[str, Query(min_length=1)],
        timeout_s: Timeout = None,
        trace: Trace = None,
    ) -> Response:
        try:
            payload = stage.input_model(text=text)
        except ValidationError as exc:
            return _json({"detail": [_query_error(e) for e in exc.errors()]}, 422)
        return await run(payload.model_dump(mode="json"), timeout_s, trace)

    app.add_api_route(
        f"/v1/{stage.name}",
        get,
        methods=["GET"],
        summary=f"{stage.summary or stage.name} (?text=)",
        tags=["models"],
        name=f"get_{stage.name}",
    )


def _query_error(error: Any) -> dict[str, Any]:
    return {"loc": ["query", *error["loc"]], "msg": error["msg"], "type": error["type"]}
