"""What conveyor's clients do, written once and free of I/O ("sans-IO").

Each operation of :class:`~conveyor.client.Client` and :class:`~conveyor.client.AsyncClient`
is a *flow* of :class:`Base`: a generator that yields what it needs done (:class:`Send` a
request, :class:`Sleep`), is answered with the outcome and returns its result. Retries, job
polling and every decision about an answer (which error it is, whether to try again) live
here; a client only runs flows, with its ``_drive``: one blocking, one awaiting. What the
clients' methods take is declared once too (:class:`Post`, :class:`Map`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Generator, Iterable, Mapping, MutableMapping
from dataclasses import KW_ONLY, dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx

from pipelines.errors import retry_after_s
from pipelines.keys import Lane
from pipelines.outcomes import CANCELLED, DONE, EXPIRED, FAILED
from pipelines.records import JobField

MAX_RETRY_WAIT_S = 5.0  # no wait between retries is longer, whatever Retry-After says
BACKOFF_S = 0.25  # the first wait after a refused connection (or a bare 503); it doubles
DEADLINE_SLACK_S = 5.0  # past a call's deadline, so that the gateway's 504 comes first
BACKLOG_WAIT_S = 60.0  # how long ``submit`` keeps retrying a 503 by default (a full backlog)

Json = dict[str, Any]
Payload = Mapping[str, Any]
Event = tuple[str, Json]

T = TypeVar("T")


class ConveyorHTTPError(Exception):
    """The gateway answered with an error, a stream ended in one, or a job failed.

    Args:
        status: the HTTP status (a failed job's ``http_status``, 499 for a cancelled one;
            502: a stream cut short).
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


def error_of(resp: httpx.Response) -> ConveyorHTTPError:
    """The error an HTTP error response stands for (its body read)."""
    detail: str | list[Any] = resp.text[:1000] or resp.reason_phrase
    request_id = resp.headers.get("X-Request-Id")
    try:
        body = resp.json()
    except ValueError:
        body = None  # not the gateway's: a proxy's error page
    if isinstance(body, dict) and isinstance(body.get("detail"), str | list):
        detail, request_id = body["detail"], body.get("request_id") or request_id
    return ConveyorHTTPError(
        resp.status_code,
        detail,
        path=resp.request.url.path,
        request_id=request_id,
        # A proxy's may be anything; what is not RFC 9110's is ignored.
        retry_after=retry_after_s(resp.headers.get("Retry-After")),
    )


def retry_in(
    failed: httpx.Response | httpx.TransportError,
    attempt: int,
    retries: int,
    busy_until: float | None = None,
) -> float:
    """Seconds to wait before retrying a failed attempt; raises its error to give up.

    Args:
        failed: what the attempt got.
        attempt: how many attempts failed before this one.
        retries: how many failed attempts are tried again.
        busy_until: a ``time.monotonic()`` before which a 503 is tried again whatever
            ``retries`` says (``submit``'s ``backlog_wait``: a full backlog drains).
    """
    error = error_of(failed) if isinstance(failed, httpx.Response) else failed
    patient = False
    if isinstance(error, ConveyorHTTPError):
        # Only a 503 says "nothing was done, try again"; 4xx, 500 and 504 would fail the
        # same way again, or may already have run the model.
        retry, retry_after = error.status == 503, error.retry_after
        patient = retry and busy_until is not None and time.monotonic() < busy_until
    else:  # A connection never opened sent nothing; other errors: only a GET is harmless.
        never_sent = isinstance(error, httpx.ConnectError | httpx.ConnectTimeout)
        retry, retry_after = never_sent or error.request.method == "GET", None
    if not retry or (attempt >= retries and not patient):
        raise error
    # A bare 503's backoff stops doubling at the cap (2**attempt would overflow a float
    # after ~1000 patient attempts).
    backoff = BACKOFF_S * 2 ** min(attempt, 16)
    return min(backoff if retry_after is None else retry_after, MAX_RETRY_WAIT_S)


FINISHED_STATUS = {FAILED: 500, EXPIRED: 504, CANCELLED: 499}
"""A job's status once it finished without a result, and its usual ``http_status``."""


def job_result(job: Json) -> Json | None:
    """A done job's result; raises for a failed, expired or cancelled one; None while it
    is queued."""
    status, job_id = job[JobField.STATUS], job[JobField.ID]
    if status == DONE:
        return dict(job[JobField.RESULT])
    if status not in FINISHED_STATUS:
        return None
    detail, path = str(job.get(JobField.ERROR, status)), f"/v1/jobs/{job_id}"
    # A gateway always says; one that does not (a proxy's rewrite) still gets its error.
    code = int(job.get(JobField.HTTP_STATUS, FINISHED_STATUS[status]))
    raise ConveyorHTTPError(code, detail, path=path, request_id=job_id)


class Events:
    """The Server-Sent Events of a streamed response, parsed a line at a time."""

    def __init__(self, resp: httpx.Response) -> None:
        self.resp, self.pending = resp, list[str]()

    def feed(self, line: str) -> Event | None:
        """Collect ``line``; the blank line that ends an event returns it as ``(event, data)``,
        or raises an ``error`` event."""
        if line:
            self.pending.append(line)
            return None
        fields = [entry.partition(":")[::2] for entry in self.pending]
        self.pending.clear()
        kind = next((value.strip() for name, value in fields if name == "event"), "message")
        raw = "\n".join(value.removeprefix(" ") for name, value in fields if name == "data")
        data = json.loads(raw) if raw else {}
        if kind == "error":
            raise self.error(int(data.get("status", 500)), str(data.get("detail", "")))
        return (kind, data) if raw else None

    def error(
        self, status: int = 502, detail: str = "the stream ended without a result"
    ) -> Exception:
        """The error the stream ends in (by default: cut short, with no result)."""
        request_id = self.resp.headers.get("X-Request-Id")
        path = self.resp.request.url.path
        return ConveyorHTTPError(status, detail, path=path, request_id=request_id)


@dataclass(frozen=True)
class Send:
    """Send ``request`` (``stream``: its body left to read). Answered with the response (an
    error response's body read) or with the ``httpx.TransportError`` that sending raised."""

    request: httpx.Request
    stream: bool = False


@dataclass(frozen=True)
class Sleep:
    """Wait ``seconds``; answered with None."""

    seconds: float


Effect = Send | Sleep
Answer = httpx.Response | httpx.TransportError | None
Flow = Generator[Effect, Any, T]
"""An operation: yields effects, is sent their answers, returns its result."""


class Post:
    """A request to pipeline ``name``: what ``call``, ``submit``, ``stream`` and
    ``stream_events`` take (see :class:`~conveyor.client.Client`)."""

    def __init__(
        self,
        name: str,
        payload: Payload | None = None,
        /,
        *,
        timeout: float | None = None,
        trace_id: str | None = None,
        priority: Lane | None = None,
        **fields: Any,
    ) -> None:
        self.name, self.body = name, {**(payload or {}), **fields}
        self.timeout, self.trace_id, self.priority = timeout, trace_id, priority


@dataclass(frozen=True)
class Map:
    """What ``map`` takes (see :meth:`~conveyor.client.Client.map`)."""

    name: str
    inputs: Iterable[Payload]
    _: KW_ONLY
    concurrency: int = 16
    progress: bool = True
    return_exceptions: bool = False
    timeout: float | None = None
    priority: Lane | None = None
    done: MutableMapping[int, Json] | None = None

    def plan(self) -> tuple[list[Payload], MutableMapping[int, Json], list[int]]:
        """The inputs, the results by input index (``done``, or a new dict) and the indexes
        still to call, in order. Raises ValueError if ``done`` holds an index the inputs do
        not have: it was kept for other inputs."""
        items, done = list(self.inputs), {} if self.done is None else self.done
        stray = [
            index for index in done if not (isinstance(index, int) and 0 <= index < len(items))
        ]
        if stray:
            raise ValueError(
                f"done holds {len(stray)} key(s) that are not indexes of the {len(items)} "
                f"inputs (e.g. {stray[0]!r}): it was kept for other inputs"
            )
        return items, done, [index for index in range(len(items)) if index not in done]

    def results(
        self, items: list[Payload], done: Mapping[int, Json], failed: Mapping[int, Exception]
    ) -> list[Json | Exception]:
        """Each input's result from ``done``, or its error from ``failed``, in input order."""
        return [failed[index] if index in failed else done[index] for index in range(len(items))]


TransportT = TypeVar("TransportT", httpx.BaseTransport, httpx.AsyncBaseTransport)
PoolT = TypeVar("PoolT", httpx.Client, httpx.AsyncClient)


class Base(Generic[TransportT, PoolT]):
    """What both clients hold (see :class:`~conveyor.client.Client` for the arguments), how
    they shape a request, and each of their operations as a flow."""

    _http: PoolT

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        timeout: float = 60,
        api_key: str | None = None,
        retries: int = 3,
        backlog_wait: float = BACKLOG_WAIT_S,
        transport: TransportT | None = None,
    ) -> None:
        self.timeout, self.retries, self.backlog_wait = timeout, retries, backlog_wait
        headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
        self._http = self._pool(transport, base_url=base_url, timeout=timeout, headers=headers)

    def _pool(self, transport: TransportT | None, **options: Any) -> PoolT:
        """The connection pool (an ``httpx.Client`` or ``httpx.AsyncClient``)."""
        raise NotImplementedError

    def _send(
        self, request: httpx.Request, stream: bool = False, busy_s: float = 0.0
    ) -> Flow[httpx.Response]:
        """Send ``request`` until it succeeds; after a failed attempt, wait :func:`retry_in`'s
        seconds and try again, or raise its error. A 503 is tried again for ``busy_s``
        seconds from the first attempt, then ``retries`` times as any other."""
        attempt, busy_until = 0, time.monotonic() + busy_s if busy_s > 0 else None
        while True:
            answer: httpx.Response | httpx.TransportError = yield Send(request, stream)
            if isinstance(answer, httpx.Response) and answer.is_success:
                return answer
            yield Sleep(retry_in(answer, attempt, self.retries, busy_until))
            attempt += 1

    def _post(
        self, path: str, post: Post, stream: bool = False, busy_s: float = 0.0
    ) -> Flow[httpx.Response]:
        headers = {"X-Conveyor-Timeout": f"{post.timeout:g}"} if post.timeout is not None else {}
        if post.trace_id is not None:
            headers["X-Trace-Id"] = post.trace_id
        if post.priority is not None:
            headers["X-Conveyor-Priority"] = post.priority
        wait_s = self.timeout if post.timeout is None else post.timeout + DEADLINE_SLACK_S
        build = self._http.build_request
        request = build("POST", path, json=post.body, headers=headers, timeout=wait_s)
        return self._send(request, stream, busy_s)

    def _call(self, post: Post) -> Flow[Json]:
        return dict((yield from self._post(f"/v1/{post.name}", post)).json())

    def _submit(self, post: Post) -> Flow[str]:
        # A job's 503 is a full backlog (the lane at ``max_backlog``), which drains: wait
        # for room for ``backlog_wait`` seconds, as a producer of many jobs needs.
        path, wait_s = f"/v1/jobs/{post.name}", self.backlog_wait
        return str((yield from self._post(path, post, busy_s=wait_s)).json()["id"])

    def _job(self, job_id: str, method: str = "GET") -> Flow[Json]:
        request = self._http.build_request(method, f"/v1/jobs/{quote(job_id, safe='')}")
        return dict((yield from self._send(request)).json())

    def _cancel(self, job_id: str) -> Flow[Json]:
        # Not sent again after a lost answer (retry_in): the first may have cancelled the
        # job, and the repeat would say 409.
        return (yield from self._job(job_id, "DELETE"))

    def _wait(self, job_id: str, timeout: float, poll_s: float) -> Flow[Json]:
        deadline = time.monotonic() + timeout
        while (result := job_result((yield from self._job(job_id)))) is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} not done after {timeout:g}s")
            yield Sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
        return result

    def _stream(self, post: Post) -> Flow[httpx.Response]:
        """The streamed response to ``post``, its events left to read."""
        return self._post(f"/v1/{post.name}/stream", post, stream=True)

    def _mapped(
        self, job: Map, index: int, item: Payload, done: MutableMapping[int, Json]
    ) -> Flow[Json]:
        """``job``'s call on ``item``, input ``index``: its result, kept in ``done`` as soon
        as it comes (so that an error elsewhere, or a stop, loses no result)."""
        post = Post(job.name, item, timeout=job.timeout, priority=job.priority)
        result = yield from self._call(post)
        done[index] = result
        return result
