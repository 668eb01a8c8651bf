"""The deadline and the size bound on a request's headers: a uvicorn protocol.

It acts before any ASGI code runs (the middleware of :mod:`gateway.edge` sees a request
only once its headers are complete), so it answers 408 and 431 itself, on the raw socket.
It also sends each response in one write (:class:`Corked`), and answers a plain call
itself, without uvicorn's cycle and the app's middleware (:mod:`gateway.direct`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol, cast

import orjson
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.corked import Corked

logger = logging.getLogger(__name__)

HEADERS_TOO_LARGE = "conveyor.headers_too_large"
"""Scope state set by :func:`header_deadline_protocol` on a request whose header block
passed the bound (the value: the bound), answered 431 by :class:`gateway.edge.EdgeMiddleware`."""


def _raw_response(status: bytes, detail: str) -> bytes:
    body = orjson.dumps({"detail": detail})
    head = (
        b"HTTP/1.1 %s\r\n"
        b"content-type: application/json\r\n"
        b"content-length: %d\r\n"
        b"connection: close\r\n\r\n"
    )
    return head % (status, len(body)) + body


REPLAYED = "conveyor.replayed"
"""Scope key of a call taken here and handed back as not valid input: the hot path
(:class:`gateway.fastpath.SyncCalls`) leaves it to the route, not validating it again."""

APP = object()
"""A valid call :meth:`DirectCalls.validated` hands back untouched (a stream: the hot path's)."""

DISCONNECT = "conveyor.disconnect"
"""Scope key of a request's :class:`Disconnect`, set by :func:`header_deadline_protocol`."""


class Disconnect:
    """What runs when a request's client goes away before its response is complete: the
    protocol puts one in each request's scope and runs it when the connection is lost, so
    a handler waiting for its answer learns of the loss without a task of its own reading
    ``receive`` (:func:`gateway.cancel.watch`).

    Args:
        resume_reading: what lets the connection be read again (flow control paused it
            while a large body came): a lost connection shows only to a read, as it
            would to the ``receive`` a watcher task awaited.
    """

    __slots__ = ("_hooks", "_resume", "lost")

    def __init__(self, resume_reading: Callable[[], None]) -> None:
        self._resume = resume_reading
        self._hooks: list[Callable[[], None]] = []
        self.lost = False

    @property
    def watched(self) -> bool:
        """Whether a hook waits on it: what the client still sends of a body is dropped
        (as a watcher reading ``receive`` dropped it), never paused on unread."""
        return bool(self._hooks)

    def add(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once the connection is lost (now, if it already is)."""
        if self.lost:
            _safely(hook)
            return
        self._hooks.append(hook)
        self._resume()

    def discard(self, hook: Callable[[], None]) -> None:
        """Do not run ``hook`` (no longer waiting)."""
        with contextlib.suppress(ValueError):
            self._hooks.remove(hook)

    def run(self) -> None:
        """The connection is lost: run the hooks, once."""
        self.lost = True
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            _safely(hook)


def _safely(hook: Callable[[], None]) -> None:
    """Run ``hook``; what it raises is logged, not the protocol's to meet."""
    try:
        hook()
    except Exception:
        logger.exception("a disconnect hook failed")


class DirectCalls(Protocol):
    """The calls a connection answers itself (:class:`gateway.direct.DirectCalls`)."""

    def take(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]]) -> Any:
        """The call, where this head is one answered on the connection; else None."""

    def validated(self, taken: Any, body: bytes) -> Any:
        """Its input; None where the app's route answers it (its body not valid input),
        :data:`APP` where the app answers it as any other call."""

    async def answer(self, taken: Any, payload: Any, disconnect: Disconnect) -> Response:
        """Its response."""

    def observe(self, taken: Any, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Record it answered (metrics, access line)."""


class _Pending:
    """A call taken on the connection, its body arriving (``keep_alive``: False once the
    server shuts down, as uvicorn marks a cycle under way)."""

    __slots__ = ("calls", "chunks", "keep_alive", "taken")

    def __init__(self, calls: DirectCalls, taken: Any) -> None:
        self.calls, self.taken = calls, taken
        self.chunks: list[bytes] = []
        self.keep_alive = True


class _NoEvent:
    """What uvicorn sets on a cycle when its connection is lost: nothing waits on it."""

    def set(self) -> None:
        """Nothing to wake."""


class _Answering:
    """A call taken on the connection being answered: where uvicorn keeps its cycle (a
    pipelined request queues behind it; a shutdown answers it, then closes)."""

    __slots__ = ("disconnect", "disconnected", "keep_alive", "response_complete")
    message_event = _NoEvent()

    def __init__(self, keep_alive: bool, disconnect: Disconnect) -> None:
        self.keep_alive, self.disconnect = keep_alive, disconnect
        self.response_complete = self.disconnected = False


def header_deadline_protocol(
    timeout_s: float,
    max_header_bytes: int = 65_536,
    calls: Callable[[], DirectCalls | None] | None = None,
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a deadline on each request's headers, and a bound
    on their size (its writes go through :class:`Corked`).

    uvicorn bounds only the idle time between requests (``timeout_keep_alive``): a client
    that opens a connection and sends nothing, or sends its headers a byte at a time, holds
    it forever; and httptools buffers a header block of any size. With this protocol a
    request's headers must be complete ``timeout_s`` after the connection opened or the
    request's first byte arrived, else the client gets 408 and the connection is closed (a
    connection that sent nothing is closed silently); and a header block past
    ``max_header_bytes`` gets 431 and the connection is closed, before it grows further.

    A plain call (a pipeline's, a job's submission, an OpenAI-compatible one not asked to
    stream) it answers itself, without uvicorn's cycle, where ``calls`` gives what takes it
    (:mod:`gateway.direct`); its body must then arrive within ``timeout_s`` of its
    headers (408, as the edge answers a late body).

    Args:
        timeout_s: the deadline (``CONVEYOR_CLIENT_TIMEOUT_S``).
        max_header_bytes: the bound (``CONVEYOR_MAX_HEADER_BYTES``).
        calls: the calls answered on the connection, once the app has settled (None:
            every request goes to the app).
    """
    response = _raw_response(
        b"408 Request Timeout", f"the request headers did not arrive within {timeout_s:g} s"
    )
    too_large = _raw_response(
        b"431 Request Header Fields Too Large",
        f"the request headers are larger than {max_header_bytes} bytes",
    )
    late = orjson.dumps({"detail": f"the request body did not arrive within {timeout_s:g} s"})

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None
        _begun = False  # bytes of the next request have arrived
        _in_headers = True  # what arrives now is (or starts) a header block
        _header_bytes = 0  # bytes received while a header block was incomplete
        _parsed = 0  # the current header block's URL and fields, as parsed
        _refusing = False  # a 431 is due once the responses before it are out
        _pending: _Pending | None = None  # a call taken here, its body arriving
        _answering: _Answering | None = None  # a call taken here, being answered

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
            corked: Any = Corked(transport, self.loop)
            super().connection_made(corked)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._begun = True
            self._in_headers, self._header_bytes, self._parsed = True, 0, 0
            self._arm()

        def on_headers_complete(self) -> None:
            self._begun = self._in_headers = False
            self._disarm()
            if not self._take():
                self._start_cycle()

        def _take(self) -> bool:
            """Whether the request is a call answered here (see the factory's doc)."""
            direct = calls() if calls is not None else None
            if (
                direct is None
                or self._parsed > max_header_bytes
                or (self.cycle is not None and not self.cycle.response_complete)
                or self.pipeline
                or self.flow.write_paused  # a client not reading: uvicorn's cycle waits
                or self.limit_concurrency is not None
                or self.parser.get_http_version() != "1.1"
                or self.parser.should_upgrade()
                or self.root_path  # mounted under a prefix: the hot path leaves it too
            ):
                return False
            taken = direct.take(self.parser.get_method(), self.url, self.headers)
            if taken is None:
                return False
            self._pending = _Pending(direct, taken)
            self._timer = self.loop.call_later(timeout_s, self._body_late)
            return True

        def _start_cycle(self) -> None:
            """Hand the request to uvicorn's cycle (the app)."""
            if self._parsed > max_header_bytes:
                # Complete, but too large (it came whole in one read, say behind a pipelined
                # request): the request still gets its turn, and EdgeMiddleware answers it
                # 431 then, so the responses before it go out first, in order.
                self.scope.setdefault("state", {})[HEADERS_TOO_LARGE] = max_header_bytes
            cast(dict[str, Any], self.scope)[DISCONNECT] = Disconnect(self.flow.resume_reading)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            pending = self._pending
            if pending is None:
                super().on_message_complete()
                return
            self._pending = None
            self._disarm()
            body = b"".join(pending.chunks)
            payload = pending.calls.validated(pending.taken, body)
            if payload is None or payload is APP:  # the app's: its cycle, the body replayed
                if payload is None:  # the route's to refuse
                    self.scope[REPLAYED] = True  # type: ignore[literal-required]
                self._start_cycle()
                if not pending.keep_alive:
                    self.cycle.keep_alive = False
                if body:
                    super().on_body(body)
                super().on_message_complete()
                return
            keep_alive = self.parser.should_keep_alive() and pending.keep_alive
            answering = _Answering(keep_alive, Disconnect(self.flow.resume_reading))
            self.cycle = answering  # type: ignore[assignment]
            self._answering = answering
            task = self.loop.create_task(self._answer(pending, payload, answering))
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)

        async def _answer(self, pending: _Pending, payload: Any, answering: _Answering) -> None:
            """Answer a call taken here, as uvicorn's cycle would send its response."""
            try:
                response = await pending.calls.answer(pending.taken, payload, answering.disconnect)
            except BaseException:  # cancelled (a shutdown past its grace): no answer
                answering.response_complete = True
                self.transport.close()
                raise
            answering.response_complete = True
            self._answering = None
            try:
                headers = response.raw_headers
                keep_alive = answering.keep_alive
                if not self.transport.is_closing():
                    cast(Corked, self.transport).send(
                        self._head(STATUS_LINE[response.status_code], headers, keep_alive)
                        + bytes(response.body)
                    )
                pending.calls.observe(pending.taken, response.status_code, headers)
            except BaseException:  # nothing may be left half-written on the connection
                self.transport.close()
                raise
            if not keep_alive:
                self.transport.close()
            self.on_response_complete()  # counted; the next pipelined request, if any

        def _head(
            self, status_line: bytes, headers: list[tuple[bytes, bytes]], keep_alive: bool
        ) -> bytes:
            """A response's status line and headers, uvicorn's default ones first."""
            head = [status_line]
            for name, value in (*self.server_state.default_headers, *headers):
                head += (name, b": ", value, b"\r\n")
            if not keep_alive:
                head.append(b"connection: close\r\n")
            head.append(b"\r\n")
            return b"".join(head)

        def shutdown(self) -> None:
            pending = self._pending
            if pending is not None:  # its body still coming: answered, then closed
                pending.keep_alive = False
                return
            super().shutdown()

        def _body_late(self) -> None:
            """A call taken here whose body did not arrive in time: 408, as the edge."""
            self._timer = None
            pending, self._pending = self._pending, None
            if pending is None or self.transport.is_closing():
                return
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(late)),
            ]
            self.transport.write(self._head(STATUS_LINE[408], headers, False) + late)
            self.transport.close()
            pending.calls.observe(pending.taken, 408, headers)

        def on_body(self, body: bytes) -> None:
            pending = self._pending
            if pending is not None:
                pending.chunks.append(body)
                return
            disconnect = cast(dict[str, Any], self.cycle.scope).get(DISCONNECT)
            if isinstance(disconnect, Disconnect) and disconnect.watched:
                return  # a body the handler did not read: dropped, reading never paused
            super().on_body(body)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._pending = None  # a call whose body never came: nothing was sent
            cycle: Any = self.cycle
            answering = self._answering
            super().connection_lost(exc)
            if answering is not None and not answering.response_complete:
                answering.disconnect.run()
            if cycle is not None and cycle is not answering and cycle.disconnected:
                disconnect = cast(dict[str, Any], cycle.scope).get(DISCONNECT)
                if isinstance(disconnect, Disconnect):
                    disconnect.run()

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
