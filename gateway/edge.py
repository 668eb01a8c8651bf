"""ASGI middleware at the edge: the body-size limit and per-route request metrics."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import Counter
from collections.abc import Iterable, Sequence

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


OPEN_PATHS = frozenset({"/healthz", "/readyz"})
"""Paths answered without an API key (probes)."""


ANONYMOUS = "anonymous"
"""The identity of a request made without an API key (keys off); no key's digest equals it."""


def identity(key: bytes) -> str:
    """A non-reversible identity of an API key (what a job record stores, never the key)."""
    return hashlib.sha256(b"conveyor-api-key\0" + key).hexdigest()


def principal(scope: Scope) -> str:
    """The identity :class:`EdgeMiddleware` authenticated the request as."""
    return str(scope.get("state", {}).get("principal", ANONYMOUS))


def key_matches(presented: bytes, keys: Sequence[bytes]) -> bool:
    """Whether ``presented`` is one of ``keys``, compared in constant time (every key is
    compared, whether or not an earlier one matched)."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key)
    return found


class EdgeMiddleware:
    """API keys (401), the body limit (413) and request metrics, before the app runs.

    A declared Content-Length over the limit is refused before any body is read; a
    chunked body is counted as it streams and refused when it passes the limit. With
    ``api_keys`` set, every path but the probes needs ``Authorization: Bearer <key>`` or
    ``X-API-Key: <key>``; the request's identity (:func:`identity` of its key, or
    :data:`ANONYMOUS` with keys off) is put in the scope's state as ``principal``.

    Args:
        app: the wrapped application.
        max_body_bytes: the limit.
        metrics: where finished requests are recorded.
        routes: paths recorded under their own label; others count as ``other``.
        api_keys: accepted keys; empty: no authentication.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        metrics: RequestMetrics,
        routes: Iterable[str],
        api_keys: Sequence[str] = (),
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.routes = frozenset(routes)
        self.api_keys = [k.encode() for k in api_keys]

    def _authenticate(self, scope: Scope) -> str | None:
        """The request's identity, or None when it needs a key and has no valid one."""
        if not self.api_keys:
            return ANONYMOUS
        headers = dict(scope["headers"])
        presented = headers.get(b"x-api-key", b"")
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer":
            presented = token.strip()
        if presented and key_matches(presented, self.api_keys):
            return identity(presented)
        # Browsers send CORS preflights (OPTIONS) without credentials; they carry no work.
        if scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return ANONYMOUS
        return None

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
            who = self._authenticate(scope)
            if who is None:
                status = 401
                await _send_json(send, 401, {"detail": "a valid API key is required"},
                                 [(b"www-authenticate", b"Bearer")])  # fmt: skip
                return
            scope["state"] = {**scope.get("state", {}), "principal": who}
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
        detail = f"request body is larger than {self.max_body_bytes} bytes"
        await _send_json(send, 413, {"detail": detail}, [(b"connection", b"close")])


async def _send_json(
    send: Send, status: int, body: dict[str, str], headers: list[tuple[bytes, bytes]]
) -> None:
    raw = orjson.dumps(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(raw)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": raw})
