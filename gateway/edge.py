"""The edge: API keys, the body-size limit, client deadlines and per-route request metrics
(ASGI middleware), and the deadline on a request's headers (a uvicorn protocol)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections import Counter
from collections.abc import Iterable, Sequence

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

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
    """API keys (401), the body limit (413), the body deadline (408) and request metrics,
    before the app runs.

    The key is checked first: a request without a valid one learns nothing else, not
    even the body limit. A declared Content-Length over the limit is refused before any
    body is read; a chunked body is counted as it streams and refused when it passes the
    limit. A body still incomplete ``client_timeout_s`` after the request started gets
    408 (and the connection is closed). With
    ``api_keys`` set, every path but the probes needs ``Authorization: Bearer <key>`` or
    ``X-API-Key: <key>``; the request's identity (:func:`identity` of its key, or
    :data:`ANONYMOUS` with keys off) is put in the scope's state as ``principal``.

    Args:
        app: the wrapped application.
        max_body_bytes: the limit.
        metrics: where finished requests are recorded.
        routes: paths recorded under their own label; others count as ``other``.
        api_keys: accepted keys; empty: no authentication.
        client_timeout_s: how long a request's body may take to arrive (None: no limit).
    """

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        metrics: RequestMetrics,
        routes: Iterable[str],
        api_keys: Sequence[str] = (),
        client_timeout_s: float | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.routes = frozenset(routes)
        self.api_keys = [k.encode() for k in api_keys]
        self.client_timeout_s = client_timeout_s

    def _authenticate(self, scope: Scope) -> str | None:
        """The request's identity, or None when it needs a key and has no valid one."""
        if not self.api_keys:
            return ANONYMOUS
        # Every credential presented must be the same valid key: a second, wrong one (or an
        # Authorization of another scheme) makes the request ambiguous, and it is refused.
        presented = []
        for name, value in scope["headers"]:
            if name == b"x-api-key":
                presented.append(value)
            elif name == b"authorization":
                scheme, _, token = value.partition(b" ")
                presented.append(token.strip() if scheme.lower() == b"bearer" else b"")
        one = presented[0] if presented and len(set(presented)) == 1 else b""
        if one and key_matches(one, self.api_keys):
            return identity(one)
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
        refused = responding = body_done = False
        loop = asyncio.get_running_loop()
        timeout = self.client_timeout_s
        body_deadline = None if timeout is None else loop.time() + timeout

        async def send_wrapper(message: Message) -> None:
            nonlocal status, responding
            if refused:  # the 413 or 408 is already out; drop what the app says after it
                return
            if message["type"] == "http.response.start":
                status, responding = message["status"], True
            await send(message)

        seen = 0

        async def receive_wrapper() -> Message:
            nonlocal seen, refused, status, body_done
            if body_done or refused or body_deadline is None:
                message = await receive()  # e.g. waiting for a disconnect: no deadline
            else:
                try:
                    async with asyncio.timeout_at(body_deadline):
                        message = await receive()
                except TimeoutError:
                    if not responding:
                        detail = f"the request body did not arrive within {timeout:g} s"
                        await _send_json(send, 408, {"detail": detail}, [CLOSE])
                    status, refused = 408, True
                    return {"type": "http.disconnect"}
            if message["type"] == "http.request" and not refused:
                body_done = not message.get("more_body", False)
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    # Answer now: the app's body parser would turn an exception into 400.
                    await self._too_large(send)
                    status, refused = 413, True
                    return {"type": "http.disconnect"}
            return message

        try:
            limit = scope.get("state", {}).get(HEADERS_TOO_LARGE)
            if limit is not None:
                status = 431
                detail = f"the request headers are larger than {limit} bytes"
                await _send_json(send, 431, {"detail": detail}, [CLOSE])
                return
            who = self._authenticate(scope)
            if who is None:
                status = 401
                challenge = [(b"www-authenticate", b"Bearer")]
                await _send_json(send, 401, {"detail": "a valid API key is required"}, challenge)
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
        await _send_json(send, 413, {"detail": detail}, [CLOSE])


CLOSE = (b"connection", b"close")

HEADERS_TOO_LARGE = "conveyor.headers_too_large"
"""Scope state set by :func:`header_deadline_protocol` on a request whose header block
passed the bound (the value: the bound), answered 431 by :class:`EdgeMiddleware`."""


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


def _raw_response(status: bytes, detail: str) -> bytes:
    body = orjson.dumps({"detail": detail})
    head = (
        b"HTTP/1.1 %s\r\n"
        b"content-type: application/json\r\n"
        b"content-length: %d\r\n"
        b"connection: close\r\n\r\n"
    )
    return head % (status, len(body)) + body


def header_deadline_protocol(
    timeout_s: float, max_header_bytes: int = 65_536
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a deadline on each request's headers, and a bound
    on their size.

    uvicorn bounds only the idle time between requests (``timeout_keep_alive``): a client
    that opens a connection and sends nothing, or sends its headers a byte at a time, holds
    it forever; and httptools buffers a header block of any size. With this protocol a
    request's headers must be complete ``timeout_s`` after the connection opened or the
    request's first byte arrived, else the client gets 408 and the connection is closed (a
    connection that sent nothing is closed silently); and a header block past
    ``max_header_bytes`` gets 431 and the connection is closed, before it grows further.

    Args:
        timeout_s: the deadline (``CONVEYOR_CLIENT_TIMEOUT_S``).
        max_header_bytes: the bound (``CONVEYOR_MAX_HEADER_BYTES``).
    """
    response = _raw_response(
        b"408 Request Timeout", f"the request headers did not arrive within {timeout_s:g} s"
    )
    too_large = _raw_response(
        b"431 Request Header Fields Too Large",
        f"the request headers are larger than {max_header_bytes} bytes",
    )

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None
        _begun = False  # bytes of the next request have arrived
        _in_headers = True  # what arrives now is (or starts) a header block
        _header_bytes = 0  # bytes received while a header block was incomplete
        _parsed = 0  # the current header block's URL and fields, as parsed
        _refusing = False  # a 431 is due once the responses before it are out

        def data_received(self, data: bytes) -> None:
            if self._refusing:
                return  # read no further into a header block that is refused
            if self._in_headers:
                self._header_bytes += len(data)
            super().data_received(data)
            # Judged after parsing: a chunk that completes the headers may carry the body,
            # and one that starts a pipelined request is counted by what was parsed.
            big = max(self._header_bytes, self._parsed) > max_header_bytes
            if self._in_headers and big and not self.transport.is_closing():
                self._refusing = True
                if self.cycle is None or self.cycle.response_complete:
                    self._refuse()
                # else: on_response_complete refuses, after the response under way

        def on_url(self, url: bytes) -> None:
            self._parsed += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._parsed += len(name) + len(value) + 4
            super().on_header(name, value)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            done = self.cycle is None or self.cycle.response_complete
            if self._refusing and done and not self.pipeline and not self.transport.is_closing():
                self._refuse()

        def _refuse(self) -> None:
            self.transport.write(too_large)
            self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._begun = True
            self._in_headers, self._header_bytes, self._parsed = True, 0, 0
            self._arm()

        def on_headers_complete(self) -> None:
            self._begun = self._in_headers = False
            self._disarm()
            if self._parsed > max_header_bytes:
                # Complete, but too large (it came whole in one read, say behind a pipelined
                # request): the request still gets its turn, and EdgeMiddleware answers it
                # 431 then, so the responses before it go out first, in order.
                self.scope.setdefault("state", {})[HEADERS_TOO_LARGE] = max_header_bytes
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._timer = self.loop.call_later(timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _headers_late(self) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                self._arm()  # a pipelined request waits for the one before it to finish
                return
            if self._begun:
                self.transport.write(response)
            self.transport.close()

    return HeaderDeadlineProtocol
