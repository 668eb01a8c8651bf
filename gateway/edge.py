"""The edge: API keys (and operator sessions), the body-size limit, client deadlines,
per-route request metrics and the access log (ASGI middleware). The deadline and bound
on a request's headers come earlier, in the uvicorn protocol of :mod:`gateway.protocol`,
which marks what it refuses here."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from urllib.parse import quote

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.alarms import Alarms
from gateway.protocol import HEADERS_TOO_LARGE
from gateway.sessions import LOGIN_URL, LOGOUT_URL, SESSION, Sessions, operator_page
from runtime.logs import hold_per_iteration, log_line
from runtime.metrics import BUCKETS, Exposition, Family, Histogram, histogram_lines

logger = logging.getLogger(__name__)
access = logging.getLogger("gateway.access")
"""One INFO line per answered request (:func:`log_access`); ``CONVEYOR_ACCESS_LOG=false``
turns it off. Its lines are written once per loop iteration (:mod:`runtime.logs`)."""
hold_per_iteration(access.name)

HTTP_REQUESTS = Family(
    "conveyor_http_requests_total",
    "counter",
    "HTTP requests this gateway answered, by route and status.",
)
HTTP_SECONDS = Family(
    "conveyor_http_request_seconds", "histogram", "Seconds this gateway took to answer, by route."
)
HTTP_FAMILIES = (HTTP_REQUESTS, HTTP_SECONDS)


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
        out = Exposition(HTTP_FAMILIES)
        for (route, status), n in sorted(self.counts.items()):
            out.sample(HTTP_REQUESTS, n, route=route, status=str(status))
        for route, h in sorted(self.latency.items()):
            out.add(
                HTTP_SECONDS,
                histogram_lines(HTTP_SECONDS.name, h.bounds, h.counts, h.sum, route=route),
            )
        return out.text()


OTHER = "other"
"""The ``route`` label of a request no route matched."""
_SUBMITTING = frozenset({"POST", "OPTIONS"})
"""The methods of a job's submission (and its CORS preflight)."""

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


_LINE = "%s %s %d %.1fms %s"
"""An access line: method, route, status, milliseconds, request id."""


def log_access(
    scope: Scope, route: str, status: int, seconds: float, headers: Iterable[tuple[bytes, bytes]]
) -> None:
    """Write a request's access line: method, route (its template where one matched, else
    its path, escaped where it holds anything unprintable), status, milliseconds and the
    request id the answer carries (``X-Request-Id``; ``-`` where it has none), also as
    ``extra`` fields (``method``, ``route``, ``status``, ``ms``, ``request_id``) for the
    JSON log. The caller checks that the line is wanted."""
    if not route.isprintable():
        route = ascii(route)
    request_id = None
    for name, value in headers:
        if name == b"x-request-id":
            request_id = value.decode("latin-1")
    ms = round(seconds * 1000, 3)
    method = scope["method"]
    extra = {"method": method, "route": route, "status": status, "ms": ms, "request_id": request_id}
    log_line(access, logging.INFO, _LINE, (method, route, status, ms, request_id or "-"), extra)


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
    With ``sessions``, the operator pages (:func:`gateway.sessions.operator_page`) also
    take a valid session cookie instead of a key (identity :data:`~gateway.sessions.SESSION`),
    ``/login`` and ``/logout`` are open, and a browser asking for an operator page without
    either (``GET``, ``Accept: text/html``) is sent to ``/login`` (303) instead of a 401.

    Args:
        app: the wrapped application.
        max_body_bytes: the limit.
        metrics: where finished requests are recorded.
        routes: the pipelines' paths and the OpenAI routes', recorded under their own
            label when no route template is known (see :meth:`_label`).
        submissions: the paths of the jobs' submissions (``/v1/jobs/{name}``): the
            same, for a ``POST`` (or its CORS preflight) alone; any other method there
            reads a job whose id is that name (``/v1/jobs/{job_id}``).
        api_keys: accepted keys; empty: no authentication.
        client_timeout_s: how long a request's body may take to arrive (None: no limit).
        access_log: write an access line per request (:func:`log_access`) when the
            ``gateway.access`` logger is enabled for INFO.
        sessions: checks operator session cookies (None: no sessions).
    """

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        metrics: RequestMetrics,
        routes: Iterable[str],
        api_keys: Sequence[str] = (),
        submissions: Iterable[str] = (),
        client_timeout_s: float | None = None,
        access_log: bool = True,
        sessions: Sessions | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.routes = frozenset(routes)
        self.submissions = frozenset(submissions)
        self.api_keys = [k.encode() for k in api_keys]
        self.client_timeout_s = client_timeout_s
        self.access_log = access_log
        self.sessions = sessions
        self._alarms = Alarms()  # the body deadlines

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
        path = scope["path"]
        if path in OPEN_PATHS or scope["method"] == "OPTIONS":
            return ANONYMOUS
        sessions = self.sessions
        if sessions is not None:
            if path in (LOGIN_URL, LOGOUT_URL):
                return ANONYMOUS
            # A cookie stands in for a key, never beside a wrong one.
            if not presented and operator_page(path) and sessions.in_headers(scope["headers"]):
                return SESSION
        return None

    def _to_login(self, scope: Scope) -> bytes | None:
        """Where a browser asking for an operator page without credentials is sent (the
        login form, coming back to the page), or None: a 401 instead."""
        path = scope["path"]
        if self.sessions is None or scope["method"] != "GET" or not operator_page(path):
            return None
        accept = dict(scope["headers"]).get(b"accept", b"")
        if b"text/html" not in accept:
            return None
        return f"{LOGIN_URL}?next={quote(path, safe='/')}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        answered: Iterable[tuple[bytes, bytes]] = ()
        refused = responding = body_done = False
        loop = asyncio.get_running_loop()
        timeout = self.client_timeout_s
        body_deadline = None if timeout is None else loop.time() + timeout

        async def send_wrapper(message: Message) -> None:
            nonlocal status, responding, answered
            if refused:  # the 413 or 408 is already out; drop what the app says after it
                return
            if message["type"] == "http.response.start":
                status, responding = message["status"], True
                answered = message.get("headers", ())
            await send(message)

        seen = 0

        async def receive_wrapper() -> Message:
            nonlocal seen, refused, status, body_done
            if body_done or refused or body_deadline is None:
                message = await receive()  # e.g. waiting for a disconnect: no deadline
            else:
                try:
                    message = await _receive_by(self._alarms, body_deadline, receive)
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
                    if not body_done:
                        await _drain(receive)
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
                login = self._to_login(scope)
                if login is not None:
                    status = 303
                    await _send_json(send, 303, {"detail": "log in"}, [(b"location", login)])
                    return
                status = 401
                challenge = [(b"www-authenticate", b"Bearer")]
                await _send_json(send, 401, {"detail": "a valid API key is required"}, challenge)
                return
            scope["state"] = {**scope.get("state", {}), "principal": who}
            declared = dict(scope["headers"]).get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                if dict(scope["headers"]).get(b"expect", b"").lower() != b"100-continue":
                    await _drain(receive)  # a client waiting sends none
                await self._too_large(send)
                status = 413
                return
            try:
                await self.app(scope, receive_wrapper, send_wrapper)
            except Exception:
                if not refused:
                    raise
            except asyncio.CancelledError:
                raise  # the server's own (a disconnect, a shutdown)
            except BaseException as exc:
                # Raised by a user's code run per request (an input model's validator):
                # one request fails, never the gateway (past this, asyncio would stop it).
                logger.error("%s raised on %s; answered 500", type(exc).__name__, scope["path"])
                status = 500
                if not responding and not refused:
                    await _send_json(send, 500, {"detail": "internal error"}, [])
        finally:
            seconds = time.perf_counter() - started
            self.record(scope, self._label(scope), status, seconds, answered)

    def record(
        self,
        scope: Scope,
        label: str,
        status: int,
        seconds: float,
        headers: Iterable[tuple[bytes, bytes]],
    ) -> None:
        """Record an answered request: its metric under ``label`` (:meth:`_label`) and,
        where wanted, its access line (its path where the label is ``other``)."""
        self.metrics.observe(label, status, seconds)
        if self.access_log and access.isEnabledFor(logging.INFO):
            route = scope["path"] if label == OTHER else label
            log_access(scope, route, status, seconds, headers)

    def _label(self, scope: Scope) -> str:
        """A request's ``route`` label: the template of the route that answered it
        (``/v1/jobs/{job_id}``), set in the scope by the router; a pipeline's path (a
        job's submission's, for a ``POST``) when it was answered before routing (refused
        at the edge, or by the hot path); else
        ``other`` (no route matched: its path is left out, so a scan cannot make a
        label per path)."""
        route = scope.get("route")
        template = getattr(route, "path", None)
        if isinstance(template, str):
            return template
        path: str = scope["path"]
        if path in self.routes or (path in self.submissions and scope["method"] in _SUBMITTING):
            return path
        return OTHER

    async def _too_large(self, send: Send) -> None:
        detail = f"request body is larger than {self.max_body_bytes} bytes"
        await _send_json(send, 413, {"detail": detail}, [CLOSE])


CLOSE = (b"connection", b"close")


class _Cutoff:
    """A deadline on one await of a task, as ``asyncio.timeout_at`` sets one (see
    :func:`_receive_by`)."""

    __slots__ = ("cancelling", "expired", "over", "task")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task: asyncio.Task[object] | None = task
        self.cancelling = task.cancelling()
        self.expired = self.over = False

    def done(self) -> bool:
        return self.over

    def expire(self) -> None:
        if self.task is not None:
            self.expired = True
            self.task.cancel()


async def _receive_by(alarms: Alarms, deadline: float, receive: Receive) -> Message:
    """``receive()``, cut short with ``TimeoutError`` at ``deadline`` (the loop's time)
    exactly as ``asyncio.timeout_at(deadline)`` around it would, on ``alarms``' timer:
    its context manager and a timer of its own cost a request's body read several times
    what the heap push does."""
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("a deadline needs a task")
    cut = _Cutoff(task)
    alarms.at(asyncio.get_running_loop(), deadline, cut.done, cut.expire)
    try:
        return await receive()
    except asyncio.CancelledError as exc:
        if cut.expired:
            cut.expired = False  # its cancellation is taken back here
            # Ours alone (no other cancellation asked meanwhile): the deadline passed.
            if task.uncancel() <= cut.cancelling:
                raise TimeoutError from exc
        raise
    finally:
        cut.over = True
        cut.task = None  # held by the alarm until it is swept: not the task with it
        if cut.expired:  # the deadline passed, yet receive ended otherwise: taken back
            task.uncancel()


DRAIN_S = 2.0
"""How long a refused body is read and dropped before its 413 (see :func:`_drain`)."""

DRAIN_BYTES = 64 << 20
"""The most of a refused body read and dropped before its 413 (see :func:`_drain`)."""


async def _drain(receive: Receive) -> None:
    """Read and drop what a client still sends of a body refused as too large, before the
    413: the connection closes after it, and a socket closed with bytes unread is reset,
    which can lose the answer before a client still sending reads it (an async client did,
    at 8 MB). Bounded by time and size alone, as a web server's lingering close is: at most
    :data:`DRAIN_S` and :data:`DRAIN_BYTES`, whatever the body limit (four times the limit
    left an 8 MB body half unread, and its client reset, when the machine was busy); past
    that the 413 goes out as before."""
    left = DRAIN_BYTES
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_S):
            while left > 0:
                message = await receive()
                if message["type"] != "http.request":
                    return
                left -= len(message.get("body", b""))
                if not message.get("more_body", False):
                    return


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
