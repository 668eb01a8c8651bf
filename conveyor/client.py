"""A client for a conveyor gateway: calls, async jobs, token streams and bulk maps.

[`Client`][] (threads) and [`AsyncClient`][] (asyncio) have the same methods. What they
do is written once, without I/O, in `conveyor._flows`: each operation is a flow there,
which yields the requests to send and the waits to sleep and returns the result. A client
runs flows with its one driver, ``_drive``, and does the I/O: blocking or awaited. E.g.
``Client().map("sentiment", [{"text": t} for t in texts], concurrency=32)``.
"""

# ruff: noqa: ASYNC109 (``timeout`` here is the gateway's deadline for a request, not a scope)
from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any, Concatenate, ParamSpec, Self, TypeVar, cast

import httpx
from tqdm import tqdm

from conveyor._flows import (
    BACKLOG_WAIT_S,
    BACKOFF_S,
    DEADLINE_SLACK_S,
    MAX_RETRY_WAIT_S,
    Answer,
    Base,
    ConveyorHTTPError,
    Effect,
    Event,
    Events,
    Flow,
    Json,
    Map,
    Payload,
    Post,
    Sleep,
)

__all__ = [  # the names the client always had, some now kept in conveyor._flows
    "BACKLOG_WAIT_S",
    "BACKOFF_S",
    "DEADLINE_SLACK_S",
    "MAX_RETRY_WAIT_S",
    "AsyncClient",
    "Client",
    "ConveyorHTTPError",
    "Event",
    "Json",
    "Payload",
]

T = TypeVar("T")
P = ParamSpec("P")
A = TypeVar("A")
S = TypeVar("S")
R = TypeVar("R")


def _taking(
    params: Callable[P, A],
) -> Callable[[Callable[[S, A], R]], Callable[Concatenate[S, P], R]]:
    """A decorator: the method takes the parameters of ``params`` and gets what ``params``
    makes of them as its one argument, so a parameter list both clients share is written once
    (`Post`, `Map`). ``help()``,
    ``inspect.signature`` and type checkers show the list as the method's own; an ``async def``
    stays a coroutine function."""

    def decorate(method: Callable[[S, A], R]) -> Callable[Concatenate[S, P], R]:
        def public(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
            return method(self, params(*args, **kwargs))

        async def awaited(self: S, /, *args: P.args, **kwargs: P.kwargs) -> Any:
            return await cast(Awaitable[Any], public(self, *args, **kwargs))

        wrapper = awaited if inspect.iscoroutinefunction(method) else public
        functools.update_wrapper(wrapper, method)
        own = inspect.signature(method)
        this = next(iter(own.parameters.values()))
        shared = list(inspect.signature(params).parameters.values())
        if shared[0].kind is inspect.Parameter.POSITIONAL_ONLY:  # then so is ``self``
            this = this.replace(kind=inspect.Parameter.POSITIONAL_ONLY)
        vars(wrapper)["__signature__"] = own.replace(parameters=[this, *shared])
        return cast(Callable[Concatenate[S, P], R], wrapper)

    return decorate


class Client(Base[httpx.BaseTransport, httpx.Client]):
    """A blocking client: one connection pool, safe to share between threads.

    Args:
        base_url: the gateway's address.
        timeout: seconds to wait on the network (to connect, for each read).
        api_key: sent as ``Authorization: Bearer <key>``.
        retries: retries of a 503 (after its ``Retry-After``, at most ``MAX_RETRY_WAIT_S``)
            or of a refused connection (backing off from ``BACKOFF_S``) before raising.
        backlog_wait: seconds [`submit`][] keeps retrying a 503 (the jobs backlog full:
            the lane at the stage's ``max_backlog``, ``CONVEYOR_MAX_BACKLOG``), each time
            after its ``Retry-After``, before its ``retries`` more; 0: a 503 to ``submit``
            is retried ``retries`` times, as a call's.
        transport: an httpx transport to use instead of the network.

    The methods take ``name``, the pipeline (``/v1/{name}``); ``payload``, the input, and/or
    ``**fields``, its fields as keywords (merged, ``fields`` win); ``timeout``, the request's
    deadline in seconds (``X-Conveyor-Timeout``, capped by the gateway; for a job, its whole
    life); ``trace_id`` (``X-Trace-Id``); ``priority``, the request's lane,
    ``"interactive"`` or ``"bulk"`` (``X-Conveyor-Priority``; None: the gateway's default,
    interactive for a call or a stream, bulk for a job). They raise
    [`ConveyorHTTPError`][] for an error answer (a 503 once ``retries`` are spent),
    ``httpx.TransportError`` for no answer.
    """

    def _pool(self, transport: httpx.BaseTransport | None, **options: Any) -> httpx.Client:
        return httpx.Client(transport=transport, **options)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drive(self, flow: Flow[T]) -> T:
        """Run ``flow``: send its requests on this client's pool, sleep its waits."""
        try:
            effect = next(flow)
            while True:
                effect = flow.send(self._perform(effect))
        except StopIteration as done:
            result: T = done.value
            return result

    def _perform(self, effect: Effect) -> Answer:
        """Do what ``effect`` asks; what it is answered with (see its class)."""
        if isinstance(effect, Sleep):
            time.sleep(effect.seconds)
            return None
        try:
            resp = self._http.send(effect.request, stream=effect.stream)
        except httpx.TransportError as exc:
            return exc
        if not resp.is_success:
            resp.read()  # a streamed error's body, before its connection is reused
            resp.close()
        return resp

    @_taking(Post)
    def call(self, post: Post) -> Json:
        """Run pipeline ``name`` on one input and return its result."""
        return self._drive(self._call(post))

    @_taking(Post)
    def submit(self, post: Post) -> str:
        """Submit an async job (``POST /v1/jobs/{name}``); returns its id, for [`wait`][]."""
        return self._drive(self._submit(post))

    def job(self, job_id: str) -> Json:
        """Job ``job_id``'s record: ``{"id", "pipeline", "status", "result"?, "error"?, ...}``."""
        return self._drive(self._job(job_id))

    def wait(self, job_id: str, *, timeout: float = 300, poll_s: float = 0.2) -> Json:
        """Poll job ``job_id`` every ``poll_s`` seconds until it is done; return its result.
        Raises ConveyorHTTPError (``status``: the job's ``http_status``) if it failed,
        expired or was cancelled (499), TimeoutError if it was not done after ``timeout``
        seconds."""
        return self._drive(self._wait(job_id, timeout, poll_s))

    def cancel(self, job_id: str) -> Json:
        """Cancel job ``job_id`` (``DELETE /v1/jobs/{id}``): no stage starts it any more.
        Returns its record, ``cancelled``; raises ConveyorHTTPError with status 409 if it
        had already finished (404: unknown, or another key's)."""
        return self._drive(self._cancel(job_id))

    @_taking(Post)
    def stream(self, post: Post) -> Generator[str]:
        """The text of a streamed generation (``POST /v1/{name}/stream``), piece by piece as
        it grows; for the final result as well, iterate [`stream_events`][]. Closing the
        iterator before the end cancels the generation."""
        with contextlib.closing(self._events(post)) as events:
            for kind, data in events:
                if kind == "token":
                    yield str(data["text"])

    @_taking(Post)
    def stream_events(self, post: Post) -> Iterator[Event]:
        """A streamed generation's events: ``("token", {"text": new_text})`` as the text grows,
        then ``("done", result)``. A refusal (422; 503 once retries are spent) or an ``error``
        event raises [`ConveyorHTTPError`][]."""
        return self._events(post)

    def _events(self, post: Post) -> Generator[Event]:
        resp = self._drive(self._stream(post))
        events = Events(resp)
        try:
            for line in resp.iter_lines():
                if event := events.feed(line):
                    yield event
                    if event[0] == "done":
                        return
        finally:
            resp.close()
        raise events.error()

    @_taking(Map)
    def map(self, job: Map) -> list[Json | Exception]:
        """[`call`][] ``name`` on each of ``inputs``; the results in their order.

        Args:
            concurrency: at most this many calls in flight (threads).
            progress: show a tqdm progress bar (on stderr).
            return_exceptions: put a failed input's exception in its place (as
                ``asyncio.gather`` does): [`ConveyorHTTPError`][] for an error answer,
                an ``httpx.TransportError`` such as ``httpx.ReadTimeout`` for none. Else the
                first error is raised once the calls not started are cancelled and those in
                flight have finished (a thread cannot be stopped mid-call).
            done: results by input index, kept across calls: each result is put in it as it
                comes, and an input already in it is not sent again. Pass the same dict to
                a second ``map`` of the same inputs after an error (or Ctrl-C) and it sends
                only what is missing. Failed inputs are never in it.
        """
        items, done, todo = job.plan()
        failed: dict[int, Exception] = {}

        def one(index: int) -> Json:
            return self._drive(self._mapped(job, index, items[index], done))

        initial = len(items) - len(todo)
        with (
            tqdm(total=len(items), initial=initial, desc=job.name, disable=not job.progress) as bar,
            ThreadPoolExecutor(job.concurrency, thread_name_prefix="conveyor-map") as pool,
        ):
            futures: dict[Future[Json], int] = {pool.submit(one, i): i for i in todo}
            try:
                for future in as_completed(futures):
                    bar.update()
                    if (error := future.exception()) is None:
                        continue
                    if not job.return_exceptions or not isinstance(error, Exception):
                        raise error
                    failed[futures[future]] = error
            except BaseException:  # the first error, or Ctrl-C: none started after it
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        return job.results(items, done, failed)


class AsyncClient(Base[httpx.AsyncBaseTransport, httpx.AsyncClient]):
    """An asyncio client: [`Client`][]'s arguments (``transport``: an async one) and
    methods, awaited (``stream`` and ``stream_events`` are async iterators)."""

    def _pool(
        self, transport: httpx.AsyncBaseTransport | None, **options: Any
    ) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=transport, **options)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _drive(self, flow: Flow[T]) -> T:
        """Run ``flow``: send its requests on this client's pool, await its waits."""
        try:
            effect = next(flow)
            while True:
                effect = flow.send(await self._perform(effect))
        except StopIteration as done:
            result: T = done.value
            return result

    async def _perform(self, effect: Effect) -> Answer:
        """Do what ``effect`` asks; what it is answered with (see its class)."""
        if isinstance(effect, Sleep):
            await asyncio.sleep(effect.seconds)
            return None
        try:
            resp = await self._http.send(effect.request, stream=effect.stream)
        except httpx.TransportError as exc:
            return exc
        if not resp.is_success:
            await resp.aread()
            await resp.aclose()
        return resp

    @_taking(Post)
    async def call(self, post: Post) -> Json:
        """[`Client.call`][]."""
        return await self._drive(self._call(post))

    @_taking(Post)
    async def submit(self, post: Post) -> str:
        """[`Client.submit`][]."""
        return await self._drive(self._submit(post))

    async def job(self, job_id: str) -> Json:
        """[`Client.job`][]: job ``job_id``'s record."""
        return await self._drive(self._job(job_id))

    async def wait(self, job_id: str, *, timeout: float = 300, poll_s: float = 0.2) -> Json:
        """[`Client.wait`][]: poll job ``job_id`` every ``poll_s`` seconds, for at most
        ``timeout`` seconds, until it is done; return its result."""
        return await self._drive(self._wait(job_id, timeout, poll_s))

    async def cancel(self, job_id: str) -> Json:
        """[`Client.cancel`][]: cancel job ``job_id``; returns its record."""
        return await self._drive(self._cancel(job_id))

    @_taking(Post)
    async def stream(self, post: Post) -> AsyncGenerator[str]:
        """[`Client.stream`][]: ``async for`` it."""
        async with contextlib.aclosing(self._events(post)) as events:
            async for kind, data in events:
                if kind == "token":
                    yield str(data["text"])

    @_taking(Post)
    def stream_events(self, post: Post) -> AsyncIterator[Event]:
        """[`Client.stream_events`][]: ``async for`` it."""
        return self._events(post)

    async def _events(self, post: Post) -> AsyncGenerator[Event]:
        resp = await self._drive(self._stream(post))
        events = Events(resp)
        try:
            async for line in resp.aiter_lines():
                if event := events.feed(line):
                    yield event
                    if event[0] == "done":
                        return
        finally:
            await resp.aclose()
        raise events.error()

    @_taking(Map)
    async def map(self, job: Map) -> list[Json | Exception]:
        """[`Client.map`][], with at most ``concurrency`` calls in flight (a semaphore).
        Without ``return_exceptions``, the first error cancels the calls in flight (the
        gateway cancels their requests) and is raised."""
        items, done, todo = job.plan()
        failed: dict[int, Exception] = {}
        gate = asyncio.Semaphore(job.concurrency)

        async def one(index: int) -> None:
            async with gate:
                try:
                    await self._drive(self._mapped(job, index, items[index], done))
                except Exception as exc:
                    if not job.return_exceptions:
                        raise
                    failed[index] = exc
                finally:
                    bar.update()

        initial = len(items) - len(todo)
        with tqdm(
            total=len(items), initial=initial, desc=job.name, disable=not job.progress
        ) as bar:
            try:
                async with asyncio.TaskGroup() as group:  # an error cancels the rest
                    for index in todo:
                        group.create_task(one(index))
            except BaseExceptionGroup as errors:
                raise errors.exceptions[0] from None
        return job.results(items, done, failed)
