"""The operational routes: ``/healthz``, ``/readyz``, ``/metrics`` and the status page."""

from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from gateway.responses import Readiness, declared
from gateway.routes import json_response
from gateway.service import Gateway
from gateway.status import status_router
from runtime.redisio import REDIS_DOWN
from runtime.stage_metrics import render_stage_metrics

NOT_READY: dict[int | str, dict[str, Any]] = {
    503: {"model": Readiness, "description": "Redis does not answer."}
}


def add_ops_routes(app: FastAPI, gw: Gateway, edge: list[int]) -> None:
    """Route health, readiness, metrics and the status page.

    Args:
        app: the application to add the routes to.
        gw: the gateway they report on.
        edge: the statuses the edge can answer first (413, and 401 with API keys on);
            the health routes are always open, so they declare 413 only.
    """

    @app.get("/healthz", tags=["ops"], responses=declared([413]))
    async def healthz() -> dict[str, str]:
        """The process is up."""
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["ops"],
        response_model=Readiness,
        responses={**declared([413]), **NOT_READY},
    )
    async def readyz() -> Response:
        """Ready to accept work: Redis answers."""
        why = await gw.unready()
        if why is None:
            return json_response({"status": "ready"})
        return json_response({"status": why}, 503, {"Retry-After": "1"})

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse, responses=declared(edge))
    async def metrics() -> PlainTextResponse:
        """Prometheus text: this gateway's requests and every routed stage's stats."""
        text = gw.metrics.render()
        try:
            text += await render_stage_metrics(gw.client, gw.keys, gw.registry.stages)
        except REDIS_DOWN:
            text += "# stage metrics unavailable: redis unreachable\n"
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    app.include_router(status_router(gw), responses=declared([*edge, 503]))
