"""The FastAPI application: the factory, its middleware, and the one place conveyor's
errors become HTTP answers (the routes themselves live in :mod:`gateway.routes`)."""

import logging
import math
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.body import WireRoute
from gateway.direct import DirectCalls, direct_calls
from gateway.docs import add_docs_routes
from gateway.edge import OPEN_PATHS, EdgeMiddleware
from gateway.enqueue import refusal
from gateway.fastpath import SyncCalls
from gateway.headers import CORS_HEADERS
from gateway.responses import openapi_document, validation_issues
from gateway.routes import json_response
from gateway.routes.jobs import add_job_routes, submission_path
from gateway.routes.login import add_login_routes
from gateway.routes.openai import add_openai_routes
from gateway.routes.openai.errors import PATHS, is_openai_path, openai_error, without_422
from gateway.routes.openai.errors import error_of as openai_error_of
from gateway.routes.openai.errors import http_error as openai_http_error
from gateway.routes.openai.serving import check_names
from gateway.routes.ops import add_ops_routes
from gateway.routes.pipelines import add_pipeline_routes
from gateway.service import Gateway
from gateway.sessions import Sessions
from gateway.settings import GatewaySettings
from gateway.traces import TELEMETRY, TraceHeaders
from pipelines.errors import RETRY_AFTER_MAX_S, ConfigError, ConveyorError, InvalidInput
from pipelines.registry import Registry, load_registry
from pipelines.settings import load_settings
from runtime import tracing
from runtime.redisio import REDIS_DOWN

logger = logging.getLogger(__name__)


def error_response(exc: ConveyorError) -> Response:
    """The HTTP response for a conveyor error: status, message, request id, Retry-After."""
    status = exc.status
    headers: dict[str, str] = {}
    if exc.retry_after is not None:
        # Bounded whatever a step or an upstream said (an hour at most; a day of digits,
        # or infinity, would reach the client as nonsense or as no header at all).
        wait = exc.retry_after if math.isfinite(exc.retry_after) else RETRY_AFTER_MAX_S
        headers["Retry-After"] = str(max(1, min(round(wait), RETRY_AFTER_MAX_S)))
    body: dict[str, Any] = {"detail": str(exc)}
    if status == 422:  # one 422 shape, whoever refuses: a list of {loc, msg, type}
        issues = exc.problems if isinstance(exc, InvalidInput) else None
        body["detail"] = (
            validation_issues(issues)
            if issues
            else [{"loc": ["body"], "msg": str(exc), "type": "value_error"}]
        )
    if exc.request_id:
        body["request_id"] = exc.request_id
        headers["X-Request-Id"] = exc.request_id
    return json_response(body, status, headers)


_PIPELINE_PATH = re.compile(r"/v1/(?:(?P<job>jobs/)?(?P<name>[^/]+)|(?P<streamed>[^/]+)/stream)")


def unknown_pipeline(method: str, path: str, registry: Registry) -> str | None:
    """The pipeline a request that matched no route names, where it names one this
    gateway does not route (``/v1/{name}``, ``/v1/{name}/stream``, ``POST
    /v1/jobs/{name}``); None for any other path."""
    match = _PIPELINE_PATH.fullmatch(path)
    if match is None or (match["job"] and method != "POST"):
        return None
    name = match["name"] or match["streamed"]
    return None if name in registry.pipelines else name


class GatewayApp(FastAPI):
    """FastAPI, without its per-request checks once they are known to be moot.

    For every request FastAPI asks whether OpenTelemetry has been configured since the
    last one (reading the environment, about a twentieth of the gateway's CPU on a small
    fast call) and whether a root path is set. Neither changes while conveyor serves:
    :meth:`settle`, at start, asks once, and with neither, HTTP requests go straight
    to the middleware stack, past the layers of it that do nothing for them
    (:func:`_without_idle_layers`). A tracer set up after the start is not seen; set it
    up before, or it is FastAPI's own per-request path that serves (as without this).
    """

    _direct: ASGIApp | None = None
    on_connection: DirectCalls | None = None
    """The calls conveyor's uvicorn protocol answers itself (:mod:`gateway.direct`): set
    with the direct path, unless tracing is on (a call's root span is FastAPI's)."""

    def settle(self) -> None:
        """Decide, once serving starts, whether requests may skip FastAPI's checks."""
        telemetry = getattr(self, "_native_telemetry", None)  # FastAPI's, where it has one
        if telemetry is None or telemetry.enabled() or self.root_path:
            return
        if self.middleware_stack is None:
            self.middleware_stack = self.build_middleware_stack()
        limit = getattr(self, "max_body_size", None)  # FastAPI's own, where it has one
        self._direct = _without_idle_layers(self.middleware_stack, limit)
        if not tracing.STATE.enabled:
            self.on_connection = direct_calls(self._direct)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        direct = self._direct
        if (
            direct is not None
            and scope["type"] == "http"
            and TELEMETRY not in scope  # set by an app this one is mounted in
            and _BODY_LIMIT not in scope
        ):
            scope["app"] = self
            await direct(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


_BODY_LIMIT = "starlette.max_body_size"
"""The scope key of a parent app's body limit (Starlette's ``MAX_BODY_SIZE_SCOPE_KEY``)."""
_IDLE = frozenset(
    {
        ("fastapi.telemetry._asgi", "ExceptionTelemetryMiddleware"),
        ("fastapi._body_limit", "AppBodyLimitMiddleware"),
    }
)
"""FastAPI's layers under its error handler that do nothing on the direct path (named,
not imported: FastAPI versions without them have nothing to skip)."""


def _without_idle_layers(stack: ASGIApp, max_body_size: int | None) -> ASGIApp:
    """``stack`` (FastAPI's) without the layers it puts under its error handler that do
    nothing for a request of :meth:`GatewayApp.__call__`'s direct path: the exception
    telemetry (it records only for a request FastAPI's telemetry wraps) and the app's
    body limit (none is set, and the scope holds no parent's). The same error handler,
    over the same middleware instances; the stack itself is kept, for every other
    request. Where the stack is not shaped as expected, it is ``stack``."""
    if not isinstance(stack, ServerErrorMiddleware) or max_body_size is not None:
        return stack
    inner: Any = stack.app
    skipped = False
    while (type(inner).__module__, type(inner).__qualname__) in _IDLE:
        inner, skipped = inner.app, True
    if not skipped:
        return stack
    return ServerErrorMiddleware(inner, handler=stack.handler, debug=stack.debug)


def create_app(
    settings: GatewaySettings | None = None, registry: Registry | None = None
) -> FastAPI:
    """Build the gateway application.

    Args:
        settings: gateway settings (default: from the environment).
        registry: pipelines to route (default: ``settings.app`` / ``settings.pipelines``,
            or the built-ins).

    Raises:
        ConfigError: a pipeline is called ``jobs``: ``/v1/jobs/...`` are the job routes;
            or as one of the OpenAI-compatible routes
            (:func:`gateway.routes.openai.serving.check_names`).
    """
    settings = settings or load_settings(GatewaySettings)
    registry = registry or load_registry(settings.app, settings.pipelines)
    if "jobs" in registry.pipelines:
        # Its /v1/jobs/stream would be one path with the submit route of a pipeline
        # called "stream"; which answered would depend on the order routes were added.
        raise ConfigError("pipeline name 'jobs' is taken by the job routes (/v1/jobs/...)")
    check_names(registry)
    gw = Gateway(settings, registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        if isinstance(app, GatewayApp):
            app.settle()
        try:
            yield
        finally:
            await gw.stop()

    app = GatewayApp(
        title="conveyor",
        summary="ML models served behind Redis Streams, batched.",
        lifespan=lifespan,
        docs_url=None,  # served from installed assets instead of a CDN: gateway/docs.py
        redoc_url=None,
    )
    add_docs_routes(app)
    app.state.gateway = gw
    app.router.route_class = WireRoute  # bodies parsed as the envelope will carry them
    edge = [413, 401] if settings.api_keys else [413]  # the edge answers these first
    app.openapi = lambda: without_422(  # type: ignore[method-assign]
        openapi_document(app, bool(settings.api_keys), OPEN_PATHS)
    )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        if is_openai_path(request.url.path):
            issues = validation_issues(exc.errors())
            first = issues[0] if issues else {"loc": [], "msg": "invalid request"}
            where = [str(p) for p in first["loc"] if p != "body"]
            param = ".".join(where) or None
            return openai_error(422, f"{param or 'body'}: {first['msg']}", param=param)
        return json_response({"detail": validation_issues(exc.errors())}, 422)

    @app.exception_handler(ConveyorError)
    async def _conveyor_error(request: Request, exc: ConveyorError) -> Response:
        if is_openai_path(request.url.path):
            return openai_error_of(exc, error_response(exc))
        return error_response(exc)

    known = sorted(registry.pipelines)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if is_openai_path(request.url.path):
            return openai_http_error(exc)
        # POST /v1/jobs/{name} of no pipeline matches GET /v1/jobs/{id}'s path: a 405.
        name = unknown_pipeline(request.method, request.url.path, registry)
        if name is not None and exc.status_code in (404, 405):
            detail = f"no pipeline {name!r}; this gateway routes: {', '.join(known)}"
            return json_response({"detail": detail, "pipelines": known}, 404)
        return await http_exception_handler(request, exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        if isinstance(exc, REDIS_DOWN):
            return error_response(refusal(exc))
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        return json_response({"detail": "internal error"}, 500)

    add_ops_routes(app, gw, edge)
    add_job_routes(app, gw, edge)
    openai = add_openai_routes(app, gw, edge)
    add_pipeline_routes(app, gw, edge)
    sessions = Sessions(settings.api_keys, settings.session_ttl_s) if settings.api_keys else None
    if sessions is not None:
        add_login_routes(app, sessions, settings.api_keys)
    # Innermost: the hot path is still behind the edge and CORS, in front of FastAPI.
    app.add_middleware(SyncCalls, gateway=gw, error_response=error_response, openai=openai)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=list(CORS_HEADERS),
        )
    app.add_middleware(  # added last: outermost, so refusals happen before anything else
        EdgeMiddleware,
        max_body_bytes=settings.max_body_bytes,
        metrics=gw.metrics,
        routes=[*(f"/v1/{name}" for name in registry.pipelines), *PATHS],
        api_keys=settings.api_keys,
        submissions=[submission_path(name) for name in registry.pipelines],
        client_timeout_s=settings.client_timeout_s,
        access_log=settings.access_log,
        sessions=sessions,
    )
    if tracing.STATE.enabled:  # outside the edge: its refusals carry a traceparent too
        app.add_middleware(TraceHeaders)
    return app
