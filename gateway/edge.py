"""ASGI middleware at the edge: the body-size limit and per-route request metrics."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipelines.stats import BUCKETS, Histogram, histogram_lines, labels


class RequestMetrics:
    """Request counts by route and status, and latency histograms by route."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, int]] = Counter()
        self.latency: dict[str, Histogram] = {}

    def observe(self, route: str, status: int, seconds: float) -> None:
        """Record one finished request."""
        self.counts[(route, status)] += 1
        hist = self.latency.get(route)
        if hist is None:
            hist = self.latency[route] = Histogram(BUCKETS["run_seconds"])
        hist.observe(seconds)

    def render(self) -> str:
        """Prometheus text of this process's request metrics."""
        out = ["# TYPE conveyor_http_requests_total counter"]
        for (route, status), n in sorted(self.counts.items()):
            out.append(f"conveyor_http_requests_total{labels(route=route, status=str(status))} {n}")
        out.append("# TYPE conveyor_http_request_seconds histogram")
        for route, h in sorted(self.latency.items()):
            out += histogram_lines(
                "conveyor_http_request_seconds", h.bounds, h.counts, h.sum, route=route
            )
        return "\n".join(out) + "\n"


class EdgeMiddleware:
    """Refuses bodies over ``max_body_bytes`` with 413 and records request metrics.

    A declared Content-Length over the limit is refused before any body is read; a
    chunked body is counted as it streams and refused when it passes the limit.

    Args:
        app: the wrapped application.
        max_body_bytes: the limit.
        metrics: where finished requests are recorded.
        routes: paths recorded under their own label; others count as ``other``.
    """

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, metrics: RequestMetrics, routes: Iterable[str]
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.routes = frozenset(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        refused = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if refused:  # the 413 is already out; drop what the app says after it
                return
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        seen = 0

        async def receive_wrapper() -> Message:
            nonlocal seen, refused, status
            message = await receive()
            if message["type"] == "http.request" and not refused:
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    # Answer now: the app's body parser would turn an exception into 400.
                    await self._too_large(send)
                    status, refused = 413, True
                    return {"type": "http.disconnect"}
            return message

        try:
            declared = dict(scope["headers"]).get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                await self._too_large(send)
                status = 413
                return
            try:
                await self.app(scope, receive_wrapper, send_wrapper)
            except Exception:
                if not refused:
                    raise
        finally:
            path = scope["path"]
            self.metrics.observe(
                path if path in self.routes else "other", status, time.perf_counter() - started
            )

    async def _too_large(self, send: Send) -> None:
        body = orjson.dumps({"detail": f"request body is larger than {self.max_body_bytes} bytes"})
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
