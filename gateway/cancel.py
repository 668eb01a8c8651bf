"""Cancellation at the gateway: a request whose client went away, or whose job is cancelled
(``DELETE /v1/jobs/{id}``), gets its marker in Redis (:func:`~runtime.jobs.mark_cancelled`).
From when Redis has it, no stage starts the request, and a batch already running it
discards its output (the workers' half).

A sync call watches for its client's disconnect while it waits (:func:`watch`); a stream
marks its request when it ends before its last event; both write the marker with one SET
(:class:`Cancellations`). Redis being down then costs the cancellation, never the process:
the request runs to its end, as before cancellation existed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from starlette.types import Receive

from gateway.background import Background
from gateway.enqueue import refusal
from gateway.protocol import Disconnect
from pipelines.errors import NotFound
from pipelines.keys import Keys
from pipelines.outcomes import QUEUED
from pipelines.records import JobField, JobRecord, job_cancelled
from runtime.jobs import mark_cancelled
from runtime.redisio import (
    REDIS_DOWN,
    RedisClock,
    in_order,
    on_live_connection,
    text,
)

logger = logging.getLogger(__name__)

MAX_PENDING = 10_000
"""Cancellation markers being written in the background at once, at most."""


class ClientGone(Exception):
    """The client of a request disconnected before its answer."""


async def disconnected(receive: Receive) -> None:
    """Return once the client has gone away (an ASGI ``http.disconnect``). Call it only once
    the request's body has been read: what arrives before the disconnect is dropped."""
    while (await receive())["type"] != "http.disconnect":
        pass


WATCHING: set[Watch] = set()
"""The watches not yet stopped by :func:`unwatch`, of every kind (tests count them)."""


@dataclass(eq=False, slots=True)
class Watch:
    """One waiting request's watch on its client: a hook on its connection's
    :class:`~gateway.protocol.Disconnect` where the server gives one (conveyor's
    protocol), else a task reading ``receive``."""

    task: asyncio.Task[None] | None = None
    disconnect: Disconnect | None = None
    hook: Callable[[], None] | None = None


def watch(
    receive: Receive,
    waiting: asyncio.Future[Any],
    request_id: str,
    disconnect: Disconnect | None = None,
) -> Watch:
    """Fail ``waiting`` with :class:`ClientGone` when the client disconnects.

    The waiter awaits ``waiting`` itself (no extra task hop when the answer comes), and
    must stop the watch with :func:`unwatch` once it is done waiting, however it ended.
    With the request's ``disconnect`` (its scope's, under conveyor's protocol) that is a
    hook the protocol runs when the connection is lost; else a task that reads
    ``receive`` until it says ``http.disconnect`` (a task created, cancelled and ended
    each call: about 10 µs of the event loop's CPU and a turn of the loop).

    Args:
        receive: the request's ASGI receive (its body already read).
        waiting: what the request's handler awaits.
        request_id: the request (names the task).
        disconnect: the request's :class:`~gateway.protocol.Disconnect`, if any.
    """
    if disconnect is not None:
        hook = partial(_gone, waiting)
        found = Watch(disconnect=disconnect, hook=hook)
        WATCHING.add(found)
        disconnect.add(hook)
        return found

    async def run() -> None:
        await disconnected(receive)
        _gone(waiting)

    found = Watch(task=asyncio.create_task(run(), name=f"disconnect-watch-{request_id}"))
    WATCHING.add(found)
    return found


def _gone(waiting: asyncio.Future[Any]) -> None:
    if not waiting.done():
        waiting.set_exception(ClientGone())


async def unwatch(found: Watch) -> None:
    """Stop a :func:`watch` (a task's ends at once: it only waits)."""
    WATCHING.discard(found)
    if found.task is None:
        if found.disconnect is not None and found.hook is not None:
            found.disconnect.discard(found.hook)
        return
    task = found.task
    task.cancel()
    # The task waits on one future, whose cancellation wakes it ahead of this task: one
    # yield lets it end. Should it be waiting on more, it is waited for.
    await asyncio.sleep(0)
    if not task.done():
        await asyncio.gather(task, return_exceptions=True)


@dataclass(eq=False)  # one per process: compared by identity
class Cancellations:
    """Writes the cancellation markers of one gateway process.

    Args:
        client: the gateway's Redis client.
        keys: key names.
        clock: the Redis clock (deadlines are on it).
        write_s: how long one write may take (pool wait included).
        job_ttl_s: how long a cancelled job's record is kept (as a finished one's).
    """

    client: aioredis.Redis
    keys: Keys
    clock: RedisClock
    write_s: float
    job_ttl_s: int
    _pending: Background = field(init=False)

    def __post_init__(self) -> None:
        self._pending = Background("cancellation", MAX_PENDING)

    async def mark(self, request_id: str, deadline: float) -> bool:
        """Mark ``request_id`` cancelled; False (and a warning) when Redis did not answer.

        Args:
            request_id: the request.
            deadline: its deadline (Redis clock): the marker outlives it.
        """

        def write() -> Any:
            keys = self.keys.of(request_id)
            return mark_cancelled(self.client, keys, request_id, deadline, self.clock.now())

        try:
            async with asyncio.timeout(self.write_s):
                await on_live_connection(self.client, write)
        except (*REDIS_DOWN, TimeoutError) as exc:
            logger.warning("request %s not cancelled, redis unreachable: %r", request_id, exc)
            return False
        return True

    def mark_soon(self, request_id: str, deadline: float) -> None:
        """:meth:`mark` in the background: for code that cannot wait (a stream's cleanup,
        which may run while its task is being cancelled)."""
        self._pending.start(request_id, self.mark(request_id, deadline))

    async def close(self) -> None:
        """Let the pending markers be written (each takes at most ``write_s``)."""
        await self._pending.finish()

    async def cancel_job(self, job_id: str, record: JobRecord) -> tuple[bool, dict[str, Any]]:
        """Cancel job ``job_id`` (its ``record`` as read, its owner checked): first its
        marker is set, so no worker starts it and none publishes its result; then, if it is
        still queued, its record says ``cancelled``.

        Returns:
            Whether it was cancelled now (False: it had already finished, cancelled
            included), and its view after.

        Raises:
            NotFound: its record expired meanwhile.
            Unavailable: Redis cannot be reached.
        """
        view = record.view(job_id, self.clock.now())
        if view[JobField.STATUS] != QUEUED:
            return False, view  # finished: a marker would change nothing
        # A record from before deadlines were kept may run for as long as it is kept.
        deadline = record.deadline or self.clock.now() + self.job_ttl_s
        keys = self.keys.of(job_id)
        key = keys.job(job_id)

        async def mark_then_read() -> list[Any]:
            # One transaction: the status read is the one the marker was set against. A
            # worker publishing after it discards its result (workers/publish.py).
            pipe = in_order(self.client)
            mark_cancelled(pipe, keys, job_id, deadline, self.clock.now())
            pipe.hgetall(key)
            return list(await pipe.execute())

        async def finish() -> Any:
            pipe = in_order(self.client)
            pipe.hset(key, mapping=job_cancelled())
            pipe.expire(key, self.job_ttl_s)  # as a finished job's record is kept
            return await pipe.execute()

        try:
            _, raw = await on_live_connection(self.client, mark_then_read)
            if not raw:  # its record expired a moment ago
                raise NotFound(f"no job {job_id!r} (expired)")
            now = JobRecord.parse(raw).view(job_id, self.clock.now())
            if now[JobField.STATUS] != QUEUED:
                return False, now
            await on_live_connection(self.client, finish)
        except REDIS_DOWN as exc:
            raise refusal(exc) from exc
        fields = {text(k): text(v) for k, v in raw.items()} | job_cancelled()
        return True, JobRecord.parse(fields).view(job_id, self.clock.now())
