"""A Python client for a conveyor gateway: calls, async jobs, token streams and bulk maps.

:class:`Client` (threads) and :class:`AsyncClient` (asyncio) have the same methods. Both
retry only what is safe to: a 503 (nothing was enqueued) after its ``Retry-After``, and a
connection that could not be opened (the gateway may be restarting). What they share
(bodies, headers, retry decisions, error and event parsing) is in the pure helpers below.

    with Client("http://127.0.0.1:8000") as conveyor:
        conveyor.call("embed", text="a cat sat on the mat")
        summary = conveyor.wait(conveyor.submit("summarize", {"text": long_text}))
        tokens = conveyor.stream("generate", text="Once upon a time")
        print("".join(tokens), tokens.result)
        conveyor.map("sentiment", [{"text": t} for t in texts], concurrency=32)
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Self
from urllib.parse import quote

import httpx
from tqdm import tqdm

MAX_RETRY_WAIT_S = 5.0
"""No wait between retries is longer than this, whatever ``Retry-After`` says."""
BACKOFF_S = 0.25
"""The first wait after a refused connection (or a 503 without ``Retry-After``); it doubles."""
DEADLINE_SLACK_S = 5.0
"""A call with a deadline waits this much longer on the socket, so that the gateway's 504
(which names the request) comes before a client-side read timeout."""

Json = dict[str, Any]


class ConveyorHTTPError(Exception):
    """The gateway answered with an error, a stream ended in one, or a job failed.

    Args:
        status: the HTTP status (an ``error`` event's ``status``, a failed job's
            ``http_status``; 502 when a stream ended without a result).
        detail: the gateway's ``detail``: a message, or for 422 a list of ``{loc, msg, type}``.
        path: the URL path that answered.
        request_id: the request (or job) id, when the gateway gave one.
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
        message = f"{status} from {path or 'the gateway'}: {_describe(detail)}"
        super().__init__(message + (f" (request {request_id})" if request_id else ""))


def _describe(detail: str | list[Any]) -> str:
    if isinstance(detail, str):
        return detail
    parts = []
    for err in detail:  # pydantic's errors: {"loc": ["body", "text"], "msg": ...}
        if isinstance(err, Mapping) and "loc" in err:
            parts.append(f"{'.'.join(map(str, err['loc']))}: {err.get('msg', '')}")
        else:
            parts.append(str(err))
    return "; ".join(parts)


def _body(payload: Mapping[str, Any] | None, fields: Mapping[str, Any]) -> Json:
    return {**(payload or {}), **fields}


def _headers(deadline: float | None, trace_id: str | None) -> dict[str, str]:
    headers = {"X-Conveyor-Timeout": f"{deadline:g}"} if deadline is not None else {}
    return headers | ({"X-Trace-Id": trace_id} if trace_id is not None else {})


def _options(base_url: str, timeout: float, api_key: str | None) -> dict[str, Any]:
    headers = {"User-Agent": "conveyor-client"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    return {"base_url": base_url, "timeout": timeout, "headers": headers}


def _retry_after(headers: httpx.Headers) -> float | None:
    try:
        return max(0.0, float(headers["Retry-After"]))
    except (KeyError, ValueError):  # absent, or an HTTP date (the gateway sends seconds)
        return None


def _wait(attempt: int, retries: int, retry_after: float | None = None) -> float | None:
    """Seconds to wait before retry ``attempt + 1``, or None when the retries are spent."""
    if attempt >= retries:
        return None
    return min(BACKOFF_S * 2**attempt if retry_after is None else retry_after, MAX_RETRY_WAIT_S)


def _wait_after(outcome: httpx.Response | httpx.TransportError, attempt: int, retries: int,
                method: str) -> float | None:  # fmt: skip
    """Whether (and after how long) to retry a failed attempt; None to give up."""
    if isinstance(outcome, httpx.Response):
        # Only a 503 says "nothing was done, try again"; 4xx, 500 and 504 would fail the
        # same way again, or may already have run the model.
        ok = outcome.status_code == 503
        return _wait(attempt, retries, _retry_after(outcome.headers)) if ok else None
    # A connection never opened carried no request; other network errors are retried
    # only where repeating the request is harmless (reading a job).
    never_sent = isinstance(outcome, httpx.ConnectError | httpx.ConnectTimeout)
    return _wait(attempt, retries) if never_sent or method == "GET" else None


def _error(resp: httpx.Response) -> ConveyorHTTPError:
    detail: str | list[Any] = resp.text[:1000] or resp.reason_phrase
    request_id = resp.headers.get("X-Request-Id")
    try:
        body = resp.json()
    except ValueError:
        body = None  # not ours: a proxy's error page
    if isinstance(body, dict) and isinstance(body.get("detail"), str | list):
        detail, request_id = body["detail"], body.get("request_id") or request_id
    retry_after = _retry_after(resp.headers)
    return ConveyorHTTPError(resp.status_code, detail, path=resp.request.url.path,
                             request_id=request_id, retry_after=retry_after)  # fmt: skip


def _job_path(job_id: str) -> str:
    return f"/v1/jobs/{quote(job_id, safe='')}"


def _job_result(job: Json) -> Json | None:
    """A finished job's result; raises for a failed or expired one; None while it is not done."""
    if job["status"] == "done":
        return dict(job["result"])
    if job["status"] in ("failed", "expired"):
        status = int(job.get("http_status", 504 if job["status"] == "expired" else 500))
        raise ConveyorHTTPError(status, str(job.get("error", job["status"])),
                                path=_job_path(job["id"]), request_id=job["id"])  # fmt: skip
    return None


class _Stream:
    """What a token stream knows, sync or async: its request id and, at its end, the result."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.request_id: str | None = None  # the gateway's X-Request-Id, once started
        self.result: Json | None = None  # the ``done`` event's data, once exhausted
        self._event, self._data = "message", list[str]()

    def _token(self, line: str) -> str | None:
        """Feed one line of Server-Sent Events; the text of a completed ``token`` event."""
        if line:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                self._event = value
            elif field == "data":
                self._data.append(value)
            return None
        kind, raw = self._event, "\n".join(self._data)
        self._event, self._data = "message", []
        data = json.loads(raw) if raw else None
        if kind == "token":
            return str(data["text"])
        if kind == "done":
            self.result = dict(data)
        elif kind == "error":
            raise ConveyorHTTPError(int(data.get("status", 500)), data.get("detail", ""),
                                    path=self.path, request_id=self.request_id)  # fmt: skip
        return None

    def _end(self) -> None:
        if self.result is None:
            raise ConveyorHTTPError(502, "the stream ended without a result", path=self.path,
                                    request_id=self.request_id)  # fmt: skip


class TokenStream(_Stream):
    """One streamed generation from :meth:`Client.stream`.

    Iterating yields each new piece of text (their concatenation is the generated text);
    once exhausted, :attr:`result` is the final result (``{"generated_text": ...}``) and
    :attr:`request_id` the gateway's id. The request is sent on the first ``next()``, which
    raises a refusal (422, or 503 once retries are spent) as :class:`ConveyorHTTPError`; so
    does an ``error`` event. Use ``with`` (or :meth:`close`) to drop a stream early.
    """

    def __init__(self, path: str, open_: Callable[[], httpx.Response]) -> None:
        super().__init__(path)
        self._tokens = self._run(open_)

    def _run(self, open_: Callable[[], httpx.Response]) -> Generator[str]:
        with open_() as resp:
            self.request_id = resp.headers.get("X-Request-Id")
            for line in itertools.chain(resp.iter_lines(), [""]):  # "": a last unended event
                if (token := self._token(line)) is not None:
                    yield token
                elif self.result is not None:
                    return
        self._end()

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> str:
        return next(self._tokens)

    def close(self) -> None:
        """Stop reading and close the connection."""
        self._tokens.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTokenStream(_Stream):
    """:class:`TokenStream` for :meth:`AsyncClient.stream`: ``async for``, ``async with``."""

    def __init__(self, path: str, open_: Callable[[], Awaitable[httpx.Response]]) -> None:
        super().__init__(path)
        self._tokens = self._run(open_)

    async def _run(self, open_: Callable[[], Awaitable[httpx.Response]]) -> AsyncGenerator[str]:
        async with await open_() as resp:
            self.request_id = resp.headers.get("X-Request-Id")
            async for line in resp.aiter_lines():
                if (token := self._token(line)) is not None:
                    yield token
                elif self.result is not None:
                    return
            if (token := self._token("")) is not None:  # a last event with no blank line
                yield token
        self._end()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> str:
        return await anext(self._tokens)

    async def aclose(self) -> None:
        """Stop reading and close the connection."""
        await self._tokens.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Client:
    """A blocking client; one connection pool, safe to share between threads.

    Args:
        base_url: the gateway's address.
        timeout: seconds to wait on the network (to connect, for each read); a request
            with a ``timeout`` of its own waits that long plus ``DEADLINE_SLACK_S``.
        api_key: sent as ``Authorization: Bearer <key>``.
        retries: retries of a 503 (after its ``Retry-After``, at most ``MAX_RETRY_WAIT_S``)
            or of a refused connection (backing off from ``BACKOFF_S``) before raising.
        transport: an httpx transport to use instead of the network.

    The methods' common arguments:

    - ``name``: the pipeline (``POST /v1/{name}``).
    - ``payload``, ``**fields``: the input object, or its fields as keywords (both: merged,
      ``fields`` win).
    - ``timeout``: the request's deadline in seconds, sent as ``X-Conveyor-Timeout`` (the
      gateway caps it); default: the gateway's.
    - ``trace_id``: sent as ``X-Trace-Id``; every stage and log line carries it.

    They raise :class:`ConveyorHTTPError` for an error answer (a 503 once ``retries`` are
    spent), and ``httpx.TransportError`` when the gateway cannot be reached.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        timeout: float = 60,
        api_key: str | None = None,
        retries: int = 3,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.timeout, self.retries = timeout, retries
        self._http = httpx.Client(transport=transport, **_options(base_url, timeout, api_key))

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        for attempt in itertools.count():
            try:
                outcome: httpx.Response | httpx.TransportError = self._http.send(
                    request, stream=stream
                )
            except httpx.TransportError as exc:
                outcome = exc
            else:
                if outcome.is_success:
                    return outcome
                outcome.read()
                outcome.close()
            if (delay := _wait_after(outcome, attempt, self.retries)) is None:
                raise _error(outcome) if isinstance(outcome, httpx.Response) else outcome
            time.sleep(delay)
        raise AssertionError("unreachable")

    def call(
        self,
        name: str,
        payload: Mapping[str, Any] | None = None,
        /,
        *,
        timeout: float | None = None,
        trace_id: str | None = None,
        **fields: Any,
    ) -> Json:
        """Run pipeline ``name`` on one input and return its result."""
        request = _post(self, f"/v1/{name}", _body(payload, fields), timeout, trace_id)
        return dict(self._send(request).json())

    def submit(
        self,
        name: str,
        payload: Mapping[str, Any] | None = None,
        /,
        *,
        timeout: float | None = None,
        trace_id: str | None = None,
        **fields: Any,
    ) -> str:
        """Submit an async job (``POST /v1/jobs/{name}``); returns its id, for :meth:`wait`.
        ``timeout`` bounds the job's whole life (the gateway caps it)."""
        request = _post(self, f"/v1/jobs/{name}", _body(payload, fields), timeout, trace_id)
        return str(self._send(request).json()["id"])

    def job(self, job_id: str) -> Json:
        """The record of job ``job_id``: ``{"id", "pipeline", "status", "result"?,
        "error"?, "http_status"?}`` (status ``queued``, ``done``, ``failed`` or ``expired``)."""
        return dict(self._send(self._http.build_request("GET", _job_path(job_id))).json())

    def wait(self, job_id: str, *, timeout: float = 300, poll_s: float = 0.2) -> Json:
        """Poll job ``job_id`` every ``poll_s`` seconds until it is done; return its result.

        Raises:
            ConveyorHTTPError: the job failed or expired (``status`` is its ``http_status``,
                ``detail`` its error, ``request_id`` the job id).
            TimeoutError: it was not done after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while (result := _job_result(self.job(job_id))) is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} not done after {timeout:g}s")
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
        return result

    def stream(
        self,
        name: str,
        payload: Mapping[str, Any] | None = None,
        /,
        *,
        timeout: float | None = None,
        trace_id: str | None = None,
        **fields: Any,
    ) -> TokenStream:
        """Stream a generation (``POST /v1/{name}/stream``): iterate the returned
        :class:`TokenStream` for the text as it grows, then read its ``result``."""
        request = _post(self, f"/v1/{name}/stream", _body(payload, fields), timeout, trace_id)
        return TokenStream(request.url.path, lambda: self._send(request, stream=True))

    def map(
        self,
        name: str,
        inputs: Iterable[Mapping[str, Any]],
        *,
        concurrency: int = 16,
        progress: bool = True,
        return_exceptions: bool = False,
        timeout: float | None = None,
    ) -> list[Json | ConveyorHTTPError]:
        """:meth:`call` ``name`` on every input, ``concurrency`` threads at a time.

        Args:
            inputs: one input object per call; the results come back in their order.
            concurrency: at most this many requests in flight.
            progress: show a tqdm progress bar on stderr.
            return_exceptions: put a failed input's :class:`ConveyorHTTPError` in its place
                instead of raising the first (other errors always raise).
        """
        items = list(inputs)
        out: list[Json | ConveyorHTTPError] = [{}] * len(items)
        with (
            ThreadPoolExecutor(concurrency, thread_name_prefix="conveyor-map") as pool,
            tqdm(total=len(items), desc=name, unit="call", disable=not progress) as bar,
        ):
            futures = {
                pool.submit(self.call, name, x, timeout=timeout): i for i, x in enumerate(items)
            }
            try:
                for future in as_completed(futures):
                    out[futures[future]] = _settle(future.result, return_exceptions)
                    bar.update()
            finally:
                pool.shutdown(cancel_futures=True)  # after an error, start no more calls
        return out


def _post(
    client: Client | AsyncClient,
    path: str,
    body: Json,
    deadline: float | None,
    trace_id: str | None,
) -> httpx.Request:
    # Waiting on the socket a little past the deadline lets the gateway's 504 arrive first.
    wait_s = (
        client.timeout if deadline is None else max(client.timeout, deadline + DEADLINE_SLACK_S)
    )
    headers = _headers(deadline, trace_id)
    return client._http.build_request("POST", path, json=body, headers=headers, timeout=wait_s)


def _settle(get: Callable[[], Json], return_exceptions: bool) -> Json | ConveyorHTTPError:
    try:
        return get()
    except ConveyorHTTPError as exc:
        if not return_exceptions:
            raise
        return exc


class AsyncClient:
    """:class:`Client` for asyncio: the same methods and arguments, awaited (but
    :meth:`stream`, which returns an :class:`AsyncTokenStream` to ``async for``).

    Args:
        base_url: the gateway's address.
        timeout: seconds to wait on the network, as for :class:`Client`.
        api_key: sent as ``Authorization: Bearer <key>``.
        retries: retries of a 503 or a refused connection, as for :class:`Client`.
        transport: an httpx async transport to use instead of the network.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        timeout: float = 60,
        api_key: str | None = None,
        retries: int = 3,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.timeout, self.retries = timeout, retries
        self._http = httpx.AsyncClient(transport=transport, **_options(base_url, timeout, api_key))

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        for attempt in itertools.count():
            try:
                outcome: httpx.Response | httpx.TransportError = await self._http.send(
                    request, stream=stream
                )
            except httpx.TransportError as exc:
                outcome = exc
            else:
                if outcome.is_success:
                    return outcome
                await outcome.aread()
                await outcome.aclose()
            if (delay := _wait_after(outcome, attempt, self.retries)) is None:
                raise _error(outcome) if isinstance(outcome, httpx.Response) else outcome
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def call(
        self,
        name: str,
        payload: Mapping[str, Any] | None = None,
        /,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the gateway's deadline)
        trace_id: str | None = None,
        **fields: Any,
    ) -> Json:
        """:meth:`Client.call`."""
        request = _post(self, f"/v1/{name}", _body(payload, fields), timeout, trace_id)
        return dict((await self._send(request)).json())

    async def submit(
        self,
        name: str,
        payload: Mapping[str, Any] | None = None,
        /,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the job's deadline)
        trace_id: str | None = None,
        **fields: Any,
    ) -> str:
        """:meth:`Client.submit`."""
        request = _post(self, f"/v1/jobs/{name}", _body(payload, fields), timeout, trace_id)
        return str((await self._send(request)).json()["id"])

    async def job(self, job_id: str) -> Json:
        """:meth:`Client.job`: the record of job ``job_id``."""
        return dict((await self._send(self._http.build_request("GET", _job_path(job_id)))).json())

    async def wait(self, job_id: str, *, timeout: float = 300, poll_s: float = 0.2) -> Json:  # noqa: ASYNC109
        """:meth:`Client.wait`: poll job ``job_id`` every ``poll_s`` seconds for at most
        ``timeout`` seconds; return its result."""
        deadline = time.monotonic() + timeout
        while (result := _job_result(await self.job(job_id))) is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} not done after {timeout:g}s")
            await asyncio.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
        return result

    def stream(
        self,
        name: str,
        payload: Mapping[str, Any] | None = None,
        /,
        *,
        timeout: float | None = None,
        trace_id: str | None = None,
        **fields: Any,
    ) -> AsyncTokenStream:
        """:meth:`Client.stream`, not awaited: ``async for`` the returned stream."""
        request = _post(self, f"/v1/{name}/stream", _body(payload, fields), timeout, trace_id)
        return AsyncTokenStream(request.url.path, lambda: self._send(request, stream=True))

    async def map(
        self,
        name: str,
        inputs: Iterable[Mapping[str, Any]],
        *,
        concurrency: int = 16,
        progress: bool = True,
        return_exceptions: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109 (each call's deadline)
    ) -> list[Json | ConveyorHTTPError]:
        """:meth:`Client.map`, with at most ``concurrency`` calls in flight (a semaphore)."""
        items = list(inputs)
        out: list[Json | ConveyorHTTPError] = [{}] * len(items)
        gate = asyncio.Semaphore(concurrency)
        with tqdm(total=len(items), desc=name, unit="call", disable=not progress) as bar:

            async def one(i: int, item: Mapping[str, Any]) -> None:
                async with gate:
                    try:
                        out[i] = await self.call(name, item, timeout=timeout)
                    except ConveyorHTTPError as exc:
                        if not return_exceptions:
                            raise
                        out[i] = exc
                bar.update()

            tasks = [asyncio.create_task(one(i, x)) for i, x in enumerate(items)]
            try:
                await asyncio.gather(*tasks)
            finally:  # after an error, stop the rest
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return out
