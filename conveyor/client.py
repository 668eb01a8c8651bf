"""A client for a conveyor gateway: calls, async jobs, token streams and bulk maps.

:class:`Client` (threads) and :class:`AsyncClient` (asyncio) have the same methods; what they
share (requests, retry decisions, error and event parsing) is in the helpers below. E.g.
``Client().map("sentiment", [{"text": t} for t in texts], concurrency=32)``.
"""

# ruff: noqa: ASYNC109 (``timeout`` here is the gateway's deadline for a request, not a scope)
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self
from urllib.parse import quote

import httpx
from tqdm import tqdm

from pipelines.records import DONE, EXPIRED, FAILED, JobField

MAX_RETRY_WAIT_S = 5.0  # no wait between retries is longer, whatever Retry-After says
BACKOFF_S = 0.25  # the first wait after a refused connection (or a bare 503); it doubles
DEADLINE_SLACK_S = 5.0  # past a call's deadline, so that the gateway's 504 comes first

Json = dict[str, Any]
Payload = Mapping[str, Any]
Event = tuple[str, Json]


class ConveyorHTTPError(Exception):
    """The gateway answered with an error, a stream ended in one, or a job failed.

    Args:
        status: the HTTP status (a failed job's ``http_status``; 502: a stream cut short).
        detail: the gateway's ``detail``: a message, or for 422 a list of ``{loc, msg, type}``.
        path: the URL path that answered.
        request_id: the request (or job) id, when there is one.
        retry_after: seconds from ``Retry-After`` (503), when given.
    """

    def __init__(
        self,
        status: int,
        detail: str | list[Any],
        *,
        path: str = "",
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.status, self.detail, self.path = status, detail, path
        self.request_id, self.retry_after = request_id, retry_after
        if not isinstance(detail, str):  # 422: "body.text: Field required; ..."
            try:
                detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in detail)
            except (KeyError, TypeError):  # not pydantic's errors after all
                detail = str(detail)
        message = f"{status} from {path or 'the gateway'}: {detail}"
        super().__init__(message + (f" (request {request_id})" if request_id else ""))


def _error(resp: httpx.Response) -> ConveyorHTTPError:
    """The error an HTTP error response stands for (its body read)."""
    detail: str | list[Any] = resp.text[:1000] or resp.reason_phrase
    request_id = resp.headers.get("X-Request-Id")
    try:
        body = resp.json()
    except ValueError:
        body = None  # not the gateway's: a proxy's error page
    if isinstance(body, dict) and isinstance(body.get("detail"), str | list):
        detail, request_id = body["detail"], body.get("request_id") or request_id
    try:
        retry_after = max(0.0, float(resp.headers["Retry-After"]))
    except (KeyError, ValueError):  # absent, or an HTTP date (the gateway sends seconds)
        retry_after = None
    return ConveyorHTTPError(
        resp.status_code,
        detail,
        path=resp.request.url.path,
        request_id=request_id,
        retry_after=retry_after,
    )


def _retry_in(failed: httpx.Response | httpx.TransportError, attempt: int, retries: int) -> float:
    """Seconds to wait before retrying a failed attempt; raises its error to give up."""
    error = _error(failed) if isinstance(failed, httpx.Response) else failed
    if isinstance(error, ConveyorHTTPError):
        # Only a 503 says "nothing was done, try again"; 4xx, 500 and 504 would fail the
        # same way again, or may already have run the model.
        retry, retry_after = error.status == 503, error.retry_after
    else:  # A connection never opened sent nothing; other errors: only a GET is harmless.
        never_sent = isinstance(error, httpx.ConnectError | httpx.ConnectTimeout)
        retry, retry_after = never_sent or error.request.method == "GET", None
    if not retry or attempt >= retries:
        raise error
    return min(BACKOFF_S * 2**attempt if retry_after is None else retry_after, MAX_RETRY_WAIT_S)


def _job_result(job: Json) -> Json | None:
    """A done job's result; raises for a failed or expired one; None while it is queued."""
    status, job_id = job[JobField.STATUS], job[JobField.ID]
    if status == DONE:
        return dict(job[JobField.RESULT])
    if status not in (FAILED, EXPIRED):
        return None
    detail, path = str(job.get(JobField.ERROR, status)), f"/v1/jobs/{job_id}"
    raise ConveyorHTTPError(int(job[JobField.HTTP_STATUS]), detail, path=path, request_id=job_id)


def _event(line: str, pending: list[str], resp: httpx.Response) -> Event | None:
    """Collect one line of Server-Sent Events into ``pending``; the blank line that ends an
    event returns it as ``(event, data)``, or raises an ``error`` event."""
    if line:
        pending.append(line)
        return None
    fields = [entry.partition(":")[::2] for entry in pending]
    pending.clear()
    kind = next((value.strip() for name, value in fields if name == "event"), "message")
    raw = "\n".join(value.removeprefix(" ") for name, value in fields if name == "data")
    data = json.loads(raw) if raw else {}
    if kind == "error":
        raise _stream_error(resp, int(data.get("status", 500)), str(data.get("detail", "")))
    return (kind, data) if raw else None


def _stream_error(resp: httpx.Response, status: int, detail: str) -> ConveyorHTTPError:
    request_id = resp.headers.get("X-Request-Id")
    return ConveyorHTTPError(status, detail, path=resp.request.url.path, request_id=request_id)


class _Base:
    """What both clients hold, and how they shape a request."""

    _http: httpx.Client | httpx.AsyncClient

    def __init__(self, base_url: str, timeout: float, api_key: str | None, retries: int) -> None:
        self.timeout, self.retries = timeout, retries
        headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
        self._options: dict[str, Any] = dict(base_url=base_url, timeout=timeout, headers=headers)

    def _post(
        self,
        path: str,
        payload: Payload | None,
        fields: Payload,
        deadline: float | None,
        trace_id: str | None,
    ) -> httpx.Request:
        headers = {"X-Conveyor-Timeout": f"{deadline:g}"} if deadline is not None else {}
        if trace_id is not None:
            headers["X-Trace-Id"] = trace_id
        wait_s = self.timeout if deadline is None else deadline + DEADLINE_SLACK_S
        body = {**(payload or {}), **fields}
        return self._http.build_request("POST", path, json=body, headers=headers, timeout=wait_s)

    def _get_job(self, job_id: str) -> httpx.Request:
        return self._http.build_request("GET", f"/v1/jobs/{quote(job_id, safe='')}")


class Client(_Base):
    """A blocking client: one connection pool, safe to share between threads.

    Args:
        base_url: the gateway's address.
        timeout: seconds to wait on the network (to connect, for each read).
        api_key: sent as ``Authorization: Bearer <key>``.
        retries: retries of a 503 (after its ``Retry-After``, at most ``MAX_RETRY_WAIT_S``)
            or of a refused connection (backing off from ``BACKOFF_S``) before raising.
        transport: an httpx transport to use instead of the network.

    The methods take ``name``, the pipeline (``/v1/{name}``); ``payload``, the input, and/or
    ``**fields``, its fields as keywords (merged, ``fields`` win); ``timeout``, the request's
    deadline in seconds (``X-Conveyor-Timeout``, capped by the gateway; for a job, its whole
    life); ``trace_id`` (``X-Trace-Id``). They raise :class:`ConveyorHTTPError` for an error
    answer (a 503 once ``retries`` are spent), ``httpx.TransportError`` for no answer.
    """

    _http: httpx.Client

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        timeout: float = 60,
        api_key: str | None = None,
        retries: int = 3,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, timeout, api_key, retries)
        self._http = httpx.Client(transport=transport, **self._options)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        attempt = 0
        while True:
            try:
                resp = self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                time.sleep(_retry_in(exc, attempt, self.retries))
            else:
                if resp.is_success:
                    return resp
                resp.read()  # a streamed error's body, before its connection is reused
                resp.close()
                time.sleep(_retry_in(resp, attempt, self.retries))
            attempt += 1

    def call(
        self,
        name: str,
        payload: Payload | None = None,
        /,
        *,
        timeout: float | None = None,
        trace_id: str | None = None,
        **fields: Any,
    ) -> Json:
        """Run pipeline ``name`` on one input and return its result."""
        request = self._post(f"/v1/{name}", payload, fields, timeout, trace_id)
        return dict(self._send(request).json())

    def submit(
        self,
        name: str,
        payload: Payload | None = None,
        /,
        *,
        timeout: float | None = None,
        trace_id: str | None = None,
        **fields: Any,
    ) -> str:
        """Submit an async job (``POST /v1/jobs/{name}``); returns its id, for :meth:`wait`."""
        request = self._post(f"/v1/jobs/{name}", payload, fields, timeout, trace_id)
        return str(self._send(request).json()["id"])

    def job(self, job_id: str) -> Json:
        """Job ``job_id``'s record: ``{"id", "pipeline", "status", "result"?, "error"?, ...}``."""
        return dict(self._send(self._get_job(job_id)).json())

    def wait(self, job_id: str, *, timeout: float = 300, poll_s: float = 0.2) -> Json:
        """Poll job ``job_id`` every ``poll_s`` seconds until it is done; return its result.
        Raises ConveyorHTTPError (``status``: the job's ``http_status``) if it failed or
        expired, TimeoutError if it was not done after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (result := _job_result(self.job(job_id))) is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} not done after {timeout:g}s")
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
        return result

    def stream(
        self,
        name: str,
        payload: Payload | None = None,
        /,
        *,
        timeout: float | None = None,
        trace_id: str | None = None,
        **fields: Any,
    ) -> Iterator[str]:
        """The text of a streamed generation (``POST /v1/{name}/stream``), piece by piece as
        it grows; for the final result as well, iterate :meth:`stream_events`."""
        for kind, data in self.stream_events(
            name, payload, timeout=timeout, trace_id=trace_id, **fields
        ):
            if kind == "token":
                yield str(data["text"])

    def stream_events(
        self,
        name: str,
        payload: Payload | None = None,
        /,
        *,
        timeout: float | None = None,
        trace_id: str | None = None,
        **fields: Any,
    ) -> Iterator[Event]:
        """A streamed generation's events: ``("token", {"text": new_text})`` as the text grows,
        then ``("done", result)``. A refusal (422; 503 once retries are spent) or an ``error``
        event raises :class:`ConveyorHTTPError`."""
        request = self._post(f"/v1/{name}/stream", payload, fields, timeout, trace_id)
        resp, pending = self._send(request, stream=True), list[str]()
        try:
            for line in resp.iter_lines():
                if event := _event(line, pending, resp):
                    yield event
                    if event[0] == "done":
                        return
        finally:
            resp.close()
        raise _stream_error(resp, 502, "the stream ended without a result")

    def map(
        self,
        name: str,
        inputs: Iterable[Payload],
        *,
        concurrency: int = 16,
        progress: bool = True,
        return_exceptions: bool = False,
        timeout: float | None = None,
    ) -> list[Json | ConveyorHTTPError]:
        """:meth:`call` ``name`` on each of ``inputs``; the results in their order.

        Args:
            concurrency: at most this many calls in flight (threads).
            progress: show a tqdm progress bar (on stderr).
            return_exceptions: put a failed input's :class:`ConveyorHTTPError` in its place
                instead of raising the first (other errors always raise).
        """

        def one(item: Payload) -> Json | ConveyorHTTPError:
            try:
                return self.call(name, item, timeout=timeout)
            except ConveyorHTTPError as exc:
                if not return_exceptions:
                    raise
                return exc

        items = list(inputs)
        with ThreadPoolExecutor(concurrency, thread_name_prefix="conveyor-map") as pool:
            # As tqdm's thread_map: progress in input order; an error cancels calls not started.
            return list(
                tqdm(pool.map(one, items), total=len(items), desc=name, disable=not progress)
            )


class AsyncClient(_Base):
    """An asyncio client: :class:`Client`'s arguments (``transport``: an async one) and
    methods, awaited (``stream`` and ``stream_events`` are async iterators)."""

    _http: httpx.AsyncClient

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        timeout: float = 60,
        api_key: str | None = None,
        retries: int = 3,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, timeout, api_key, retries)
        self._http = httpx.AsyncClient(transport=transport, **self._options)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        attempt = 0
        while True:
            try:
                resp = await self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                await asyncio.sleep(_retry_in(exc, attempt, self.retries))
            else:
                if resp.is_success:
                    return resp
                await resp.aread()
                await resp.aclose()
                await asyncio.sleep(_retry_in(resp, attempt, self.retries))
            attempt += 1

    async def call(
        self,
        name: str,
        payload: Payload | None = None,
        /,
        *,
        timeout: float | None = None,
        trace_id: str | None = None,
        **fields: Any,
    ) -> Json:
        """:meth:`Client.call`."""
        request = self._post(f"/v1/{name}", payload, fields, timeout, trace_id)
        return dict((await self._send(request)).json())

    async def submit(
        self,
        name: str,
        payload: Payload | None = None,
        /,
        *,
        timeout: float | None = None,
        trace_id: str | None = None,
        **fields: Any,
    ) -> str:
        """:meth:`Client.submit`."""
        request = self._post(f"/v1/jobs/{name}", payload, fields, timeout, trace_id)
        return str((await self._send(request)).json()["id"])

    async def job(self, job_id: str) -> Json:
        """:meth:`Client.job`: job ``job_id``'s record."""
        return dict((await self._send(self._get_job(job_id))).json())

    async def wait(self, job_id: str, *, timeout: float = 300, poll_s: float = 0.2) -> Json:
        """:meth:`Client.wait`: poll job ``job_id`` every ``poll_s`` seconds, for at most
        ``timeout`` seconds, until it is done; return its result."""
        deadline = time.monotonic() + timeout
        while (result := _job_result(await self.job(job_id))) is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} not done after {timeout:g}s")
            await asyncio.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
        return result

    async def stream(
        self,
        name: str,
        payload: Payload | None = None,
        /,
        *,
        timeout: float | None = None,
        trace_id: str | None = None,
        **fields: Any,
    ) -> AsyncIterator[str]:
        """:meth:`Client.stream`: ``async for`` it."""
        async for kind, data in self.stream_events(
            name, payload, timeout=timeout, trace_id=trace_id, **fields
        ):
            if kind == "token":
                yield str(data["text"])

    async def stream_events(
        self,
        name: str,
        payload: Payload | None = None,
        /,
        *,
        timeout: float | None = None,
        trace_id: str | None = None,
        **fields: Any,
    ) -> AsyncIterator[Event]:
        """:meth:`Client.stream_events`: ``async for`` it."""
        request = self._post(f"/v1/{name}/stream", payload, fields, timeout, trace_id)
        resp, pending = await self._send(request, stream=True), list[str]()
        try:
            async for line in resp.aiter_lines():
                if event := _event(line, pending, resp):
                    yield event
                    if event[0] == "done":
                        return
        finally:
            await resp.aclose()
        raise _stream_error(resp, 502, "the stream ended without a result")

    async def map(
        self,
        name: str,
        inputs: Iterable[Payload],
        *,
        concurrency: int = 16,
        progress: bool = True,
        return_exceptions: bool = False,
        timeout: float | None = None,
    ) -> list[Json | ConveyorHTTPError]:
        """:meth:`Client.map`, with at most ``concurrency`` calls in flight (a semaphore)."""
        gate = asyncio.Semaphore(concurrency)

        async def one(item: Payload) -> Json | ConveyorHTTPError:
            async with gate:
                try:
                    return await self.call(name, item, timeout=timeout)
                except ConveyorHTTPError as exc:
                    if not return_exceptions:
                        raise
                    return exc
                finally:
                    bar.update()

        items = list(inputs)
        with tqdm(total=len(items), desc=name, disable=not progress) as bar:
            try:
                async with asyncio.TaskGroup() as group:  # an error cancels the rest
                    tasks = [group.create_task(one(item)) for item in items]
            except BaseExceptionGroup as failed:
                raise failed.exceptions[0] from None
        return [task.result() for task in tasks]
