"""The gateway's writes of admitted requests to Redis: what a refusal promises (nothing of
the request takes effect), requests enqueued in one round trip per loop iteration, and
what a client is told when Redis cannot take them."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.alarms import Alarms
from gateway.settings import GatewaySettings
from gateway.withdraw import Withdrawals
from pipelines.envelope import Request
from pipelines.errors import ConveyorError, DeadlineExceeded, Overloaded, Unavailable
from pipelines.keys import Keys
from runtime.jobs import create_job
from runtime.pool import SATURATED
from runtime.redisio import (
    REDIS_DOWN,
    REFUSED,
    IdsAhead,
    RedisClock,
    RedisRefused,
    enqueue,
    enqueue_burst,
    in_order,
    on_live_connection,
    request_stream,
)

logger = logging.getLogger(__name__)


def refusal(exc: BaseException) -> ConveyorError:
    """What a client is told when a Redis command failed with one of :data:`REDIS_DOWN`:
    overload (503) when this process waited too long for a pooled connection, else that
    the queue is unreachable or refusing commands (503); all with a Retry-After."""
    if isinstance(exc, SATURATED):
        return Overloaded(f"the gateway is saturated: {exc}; retry shortly", retry_after=1.0)
    if isinstance(exc, OutOfMemoryError):
        return Unavailable("the queue is full (Redis is out of memory); retry later", 5.0)
    if isinstance(exc, RedisRefused | ReadOnlyError):
        code = getattr(exc, "status_code", None) or "READONLY"
        return Unavailable(f"the queue refuses commands for now ({code}); retry shortly", 1.0)
    return Unavailable("the queue is unreachable; retry shortly", 1.0)


@dataclass(eq=False)  # one per process: compared by identity
class Writer:
    """Writes admitted requests, so that a refusal is true: a client told 503 is told that
    nothing of its request takes effect.

    A call's entry goes with the others of its moment (:class:`Enqueuer`); a job's record
    and its entry go together, so a job id handed out exists. A write Redis refused took
    no effect; one whose answer was lost (or that ran past ``write_s``) may have landed,
    so it is settled first (:class:`~gateway.withdraw.Withdrawals`): withdrawn, then
    refused, or found to have run, then accepted.

    Args:
        client: the gateway's Redis client.
        keys: the namespace's key names.
        clock: the Redis clock (deadlines and ``enqueue_by`` are on it).
        settings: the gateway's settings (``redis_timeout_s``, ``job_ttl_s``).
    """

    client: aioredis.Redis
    keys: Keys
    clock: RedisClock
    settings: GatewaySettings
    enqueuer: Enqueuer = field(init=False)
    withdrawals: Withdrawals = field(init=False)

    def __post_init__(self) -> None:
        self.enqueuer = Enqueuer(self.client, self.keys, self.write_s, self.clock)
        self.withdrawals = Withdrawals(self.client, self.keys, self.clock)

    @property
    def write_s(self) -> float:
        """How long one write may take: a wait for a pooled connection, then one for
        Redis's answer (each ``redis_timeout_s``), a retry included."""
        return 2 * self.settings.redis_timeout_s

    def enqueue_by(self) -> float:
        """When, on the Redis clock, an entry written now must have arrived: the end of the
        write's time, plus the clock's error both ways and a margin."""
        return self.clock.now() + self.write_s + 2 * self.clock.error + 0.5

    async def write(self, request: Request, timeout_s: float, owner: str | None = None) -> None:
        """Put ``request`` on its entry stage's stream (with its job record, for a job).

        Args:
            request: the admitted request.
            timeout_s: its time budget.
            owner: a job's owner, its record written with the entry (None: a call,
                answered on this gateway's reply stream).

        Raises:
            Overloaded: no pooled connection came free; nothing was sent.
            Unavailable: Redis refused the write, or its answer was lost and the request
                is withdrawn (or is being withdrawn: Redis did not answer).
        """
        try:
            # Safe to repeat (see on_live_connection): a request enqueued twice runs once.
            # The whole write, pool wait and retry included, ends within write_s, so a
            # write this gateway saw succeed always arrived before the entry's enqueue_by.
            if owner is not None:
                async with asyncio.timeout(self.write_s):
                    await on_live_connection(self.client, lambda: self._job(request, owner))
            else:  # with the other calls of this moment, in one round trip
                await self.enqueuer.enqueue(request)
        except SATURATED as exc:
            raise refusal(exc) from exc  # no connection came free: nothing was sent
        except REFUSED as exc:
            # Redis answered that it did not run the write: answered at once, not settled.
            # On a cluster a job's record and its entry are two commands, not a
            # transaction: a record written before the refusal is withdrawn.
            if owner is not None:
                self.withdrawals.start(request, timeout_s)
            raise refusal(exc) from exc
        except (*REDIS_DOWN, TimeoutError) as exc:
            # The write may have landed and run (its answer lost, or Redis stalled): a 503
            # must mean it takes no effect, so its withdrawal is settled first, within the
            # write's time again; one that ran is answered as accepted.
            within = min(self.write_s, max(0.0, request.deadline - self.clock.now()))
            settled = await self.withdrawals.settle(request, timeout_s, within)
            if settled is not False:
                if isinstance(exc, TimeoutError):
                    exc = RedisTimeoutError(f"no answer within {self.write_s:g}s")
                raise refusal(exc) from exc

    async def _job(self, request: Request, owner: str) -> None:
        # The record and the request appear together: a job id handed out exists.
        pipe = in_order(self.client)
        create_job(pipe, request, owner, self.settings.job_ttl_s)
        enqueue(pipe, self.keys, request)
        written = await pipe.execute()
        self.enqueuer.written(request, written[-1], self.clock.now())

    async def close(self) -> None:
        """Stop the withdrawals still under way (the process is stopping)."""
        await self.withdrawals.abandon()


class Enqueuer:
    """Enqueues requests, those enqueued in the same loop iteration in one round trip.

    Concurrent callers (a gateway under load) each :meth:`enqueue` one request. The first
    of an iteration starts a round trip (a task of its own, which runs once the others of
    that iteration have joined it): every XADD in one MULTI/EXEC (each entry still its
    own: an XADD Redis refuses fails only its caller; on a cluster, one pipeline per
    partition), each caller handed its own outcome. One request alone is one XADD, as
    before. Each caller waits for its outcome within its own request's time; the round
    trip is not the caller's to cancel.

    Nothing joined is dropped: a round trip that fails fails every request in it, with
    what it saw (one stopped midway fails them with a connection error, as a write that
    may have been sent); an XADD that Redis refuses fails its own caller.

    Args:
        client: the client to send on.
        keys: the namespace's key names.
        write_s: how long one round trip may take, pool wait and retry included; past it
            every request in it fails with ``TimeoutError``.
        clock: the Redis clock, entry ids are checked against (:meth:`written`); by
            default this host's clock, uncalibrated.
    """

    def __init__(
        self, client: aioredis.Redis, keys: Keys, write_s: float, clock: RedisClock | None = None
    ) -> None:
        self.client = client
        self.keys = keys
        self.write_s = write_s
        self.clock = clock or RedisClock()
        self.ahead = IdsAhead("gateway")
        self._joining: list[tuple[Request, asyncio.Future[None]]] | None = None
        self._leading: set[asyncio.Task[None]] = set()  # round trips under way
        self._alarms = Alarms()

    async def enqueue(self, request: Request) -> None:
        """XADD ``request`` (see the class doc), retried once on a dead connection
        (:func:`on_live_connection`). The caller waits for its answer no longer than its
        request's deadline (nor ``write_s``): a Redis that stalls does not hold a call past
        the time its client gave it; the round trip goes on for the others in it.

        Raises:
            PoolExhausted: no connection came free; nothing was sent.
            TimeoutError: no answer within ``write_s`` or by the request's deadline; it
                may have been sent.
            redis.exceptions.RedisError: the round trip failed (one of
                :data:`REDIS_DOWN`: it may have been sent), or Redis refused this XADD.
        """
        left_s = request.deadline - self.clock.now()
        if left_s <= 0:  # nothing sent: nobody waits for it any more
            raise DeadlineExceeded("the deadline passed before the request was enqueued")
        loop = asyncio.get_running_loop()
        mine: asyncio.Future[None] = loop.create_future()
        if self._joining is not None:
            self._joining.append((request, mine))
        else:  # the first of this iteration: its round trip, for all who join it
            batch = self._joining = [(request, mine)]
            lead = asyncio.create_task(self._lead(batch))
            self._leading.add(lead)
            lead.add_done_callback(lambda task: self._ended(task, batch))
        # Out of time (or cancelled), the wait ends its own outcome only: the round trip
        # skips it and goes on for the others.
        self._alarms.fail_at(loop, loop.time() + min(self.write_s, left_s), mine)
        await mine

    async def _lead(self, joining: list[tuple[Request, asyncio.Future[None]]]) -> None:
        """One round trip for the requests that joined in this iteration (each caller
        waits for its own outcome, within its own time)."""
        if self._joining is joining:
            self._joining = None
        batch = [(r, f) for r, f in joining if not f.done()]  # a caller gone: not sent
        if not batch:
            return
        requests = [r for r, _ in batch]
        try:
            async with asyncio.timeout(self.write_s):
                outcomes = await on_live_connection(self.client, lambda: self._send(requests))
        except Exception as exc:
            for _, joined in batch:
                if not joined.done():
                    joined.set_exception(exc)
            return
        now = self.clock.now()
        for (sent, joined), outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, bytes | str):
                self.written(sent, outcome, now)
            if joined.done():
                continue
            if isinstance(outcome, Exception):
                joined.set_exception(outcome)
            else:
                joined.set_result(None)

    def _ended(
        self, lead: asyncio.Task[None], batch: list[tuple[Request, asyncio.Future[None]]]
    ) -> None:
        """A round trip ended: one stopped midway, or before it began (the process
        stopping), fails those still waiting with a connection error, as a write that may
        have been sent; none joins it any more."""
        self._leading.discard(lead)
        if not lead.cancelled() and lead.exception() is not None:  # a bug, not Redis
            logger.error("an enqueue round trip failed", exc_info=lead.exception())
        if self._joining is batch:
            self._joining = None
        for _, joined in batch:
            if not joined.done():
                joined.set_exception(RedisConnectionError("write abandoned"))

    def written(self, request: Request, entry_id: bytes | str, now: float) -> None:
        """``request`` was enqueued as ``entry_id``: a stream whose ids run ahead of the
        clock is reported (once), as workers would drop requests on such a stream's ids
        if they took them as times."""
        self.ahead.check(request_stream(self.keys, request), entry_id, now)

    async def _send(self, requests: list[Request]) -> list[Any]:
        if not isinstance(self.client, RedisCluster):
            # Several in one MULTI/EXEC: Redis serves a worker blocked on the stream once
            # every entry is in (after a plain pipeline's first XADD, it read one entry
            # and came back for the rest). Each XADD still answers alone; one refused as
            # it is queued (OOM) aborts the EXEC, and every caller gets that refusal.
            return await enqueue_burst(self.client, self.keys, requests)
        if len(requests) == 1:
            try:
                return [await enqueue(self.client, self.keys, requests[0])]
            except ResponseError as exc:
                return [exc]
        # On a cluster, each partition's XADDs go in a round trip of their own, side by
        # side: a shard down fails its partition's requests, not the others' (one
        # pipeline over every shard fails whole, though the others' entries were added).
        parts: dict[int, list[int]] = {}
        for i, request in enumerate(requests):
            parts.setdefault(self.keys.of(request.id).partition, []).append(i)
        outcomes: list[Any] = [None] * len(requests)

        async def send(rows: list[int]) -> None:
            pipe = self.client.pipeline(transaction=False)
            for i in rows:
                enqueue(pipe, self.keys, requests[i])
            try:
                answers = list(await pipe.execute(raise_on_error=False))
            except REDIS_DOWN as exc:
                answers = [exc] * len(rows)
            for i, answer in zip(rows, answers, strict=True):
                outcomes[i] = answer

        await asyncio.gather(*(send(rows) for rows in parts.values()))
        return outcomes
