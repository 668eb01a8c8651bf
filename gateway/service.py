"""The gateway's core: admit a request, enqueue it, await its reply."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.types import Receive

from gateway import traces
from gateway.admission import Admission
from gateway.alarms import Alarms
from gateway.body import problem_detail
from gateway.cancel import Cancellations, ClientGone, unwatch, watch
from gateway.edge import ANONYMOUS, RequestMetrics
from gateway.enqueue import Writer, refusal
from gateway.headers import Sent
from gateway.history import History
from gateway.protocol import Disconnect
from gateway.replies import Abandoned, ReplyDispatcher
from gateway.settings import GatewaySettings
from pipelines.envelope import Reply, Request, new_request_id, wire_problem
from pipelines.errors import (
    Cancelled,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    NotFound,
    Unavailable,
)
from pipelines.graph import Pipeline
from pipelines.keys import Lane
from pipelines.records import JobRecord
from pipelines.registry import Registry
from pipelines.stages import Stage
from runtime.definitions import check_served
from runtime.pool import SATURATED
from runtime.redisio import (
    REDIS_DOWN,
    RedisClock,
    agree_on_partitions,
    connect,
    on_live_connection,
)
from runtime.waiting import cancel_and_wait

logger = logging.getLogger(__name__)


class Gateway:
    """Everything one gateway process holds: connections, reply loop, admission.

    Args:
        settings: the gateway's settings.
        registry: the pipelines it routes, and their stages.
    """

    def __init__(self, settings: GatewaySettings, registry: Registry) -> None:
        self.settings = settings
        self.registry = registry
        self.keys = settings.keys
        self.gateway_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        # One per partition: a worker publishes a reply in its request's slot.
        self.reply_streams = [k.reply_stream(self.gateway_id) for k in self.keys.each()]
        self.clock = RedisClock()
        self.metrics = RequestMetrics()
        self.client: aioredis.Redis = connect(settings)
        # Each partition's reply stream blocks a connection of its own on a cluster.
        readers = len(self.reply_streams) + 2
        self._reader = connect(settings, block_ms=settings.reply_block_ms, connections=readers)
        self.replies = ReplyDispatcher(
            self._reader, self.reply_streams, settings.reply_block_ms, per_slot=settings.cluster
        )
        self.admission = Admission(
            self.client,
            self.keys,
            settings.admission_refresh_ms / 1000.0,
            settings.retry_after_s,
            settings.admission_headroom,
        )
        self._task: asyncio.Task[None] | None = None
        self._calibrating: asyncio.Task[None] | None = None
        self.misconfigured: str | None = None  # why it cannot serve (a late-found mismatch)
        self.writer = Writer(self.client, self.keys, self.clock, settings)
        self.cancellations = Cancellations(
            self.client, self.keys, self.clock, self.writer.write_s, settings.job_ttl_s
        )
        self.history = History(self.client, self.keys, registry.stages, self.clock)
        self.draining = False  # set by drain(): no new request is taken
        self._abandon: asyncio.TimerHandle | None = None
        self.alarms = Alarms()  # the sync calls' deadlines

    async def start(self) -> None:
        """Start the reply loop; Redis being down is not fatal (requests get 503).

        Raises:
            ConfigError: the namespace runs with another partition count.
        """
        try:
            await self.clock.calibrate(self.client)
            await agree_on_partitions(self.client, self.keys)
            await check_served(self.client, self.keys, self.registry.stages.values())
        except REDIS_DOWN as exc:
            logger.warning("redis unreachable at start (%s); serving 503 until it is back", exc)
        self._task = asyncio.create_task(self.replies.run(), name="reply-dispatcher")
        self._task.add_done_callback(_surface)
        self.history.start()
        logger.info("gateway %s routing %s", self.gateway_id, ", ".join(self.registry.pipelines))

    async def drain(self, within_s: float) -> None:
        """Stop taking requests; return once those in flight are answered, which takes
        at most ``within_s`` (and the moment their handlers take to answer).

        From now on a new request is refused with 503 + Retry-After before anything is
        enqueued (so the client may safely send it again, elsewhere or later), and
        ``/readyz`` says 503. The workers are still running (``conveyor up`` stops them
        only once its gateways have exited), so a request in flight gets its answer;
        one still waiting after ``within_s`` is answered 504 and marked cancelled
        (nobody will read its answer). So the server's shutdown that follows never has
        to cancel a request, which uvicorn would answer with a plain-text 500 and a
        traceback.

        Args:
            within_s: how long requests in flight may still take.
        """
        if not self.draining:
            self.draining = True
            logger.info("draining: new requests get 503; those in flight have %gs", within_s)
            loop = asyncio.get_running_loop()
            self._abandon = loop.call_later(within_s, self._abandon_all, within_s)
        with contextlib.suppress(TimeoutError):
            # A stream's client that reads nothing holds its waiter: bounded all the same.
            await asyncio.wait_for(self.replies.settled(), within_s + 1.0)

    def _abandon_all(self, within_s: float) -> None:
        left = self.replies.abandon(
            f"the gateway stopped: no result within its {within_s:g}s drain"
        )
        if left:
            logger.warning("drain over: %d request(s) still waiting answered 504", left)

    async def stop(self) -> None:
        """Stop the reply loop and close connections."""
        if self._abandon is not None:
            self._abandon.cancel()
        if self._task is not None:
            self.replies.stop()
            grace = self.settings.reply_block_ms / 1000 + self.settings.redis_timeout_s
            done, _ = await asyncio.wait([self._task], timeout=grace)
            if not done:
                await cancel_and_wait([self._task])
        if self._calibrating is not None:
            await cancel_and_wait([self._calibrating])
        await self.admission.close()
        await self.history.stop()
        await self.writer.close()
        await self.cancellations.close()
        try:  # nobody will read them again; without this they linger until their TTL
            for stream in self.reply_streams:  # one at a time: each in its own slot
                await self.client.delete(stream)
        except REDIS_DOWN as exc:
            logger.warning("reply streams %s left to expire: %s", self.reply_streams, exc)
        await self._reader.aclose()
        await self.client.aclose()

    def timeout_for(self, asked: float | None, *, job: bool = False) -> float:
        """The request's time budget: what it asked for, within the bounds."""
        if job:
            return min(asked or self.settings.job_timeout_s, self.settings.job_timeout_s)
        if asked is None:
            return self.settings.default_timeout_s
        return min(asked, self.settings.max_timeout_s)

    async def unready(self) -> str | None:
        """Why this gateway is not ready, or None: Redis answers (a stage with no worker
        is not a readiness failure), it is configured as the namespace is, and it is not
        draining. What Redis said is said (``LOADING``, ``MISCONF``, a refused connection)."""
        if self.misconfigured is not None:
            return "misconfigured"
        if self.draining:
            return "draining"
        try:
            await self.client.ping()
        except SATURATED:
            return None  # saturated, not down: taking it out of rotation would only spread it
        except REDIS_DOWN as exc:
            # What Redis or the connection said, not where in conveyor it was raised: the
            # probe is open to anyone who reaches the port.
            said = " ".join(str(exc).split())[:300]
            return f"redis unreachable: {type(exc).__name__}: {said}"
        return None

    async def enqueue(
        self,
        pipeline: Pipeline,
        payload: dict[str, Any],
        sent: Sent,
        *,
        request_id: str | None = None,
        stream: bool = False,
        job: bool = False,
        owner: str = ANONYMOUS,
    ) -> Request:
        """Admit a request and put it on its entry step's stream.

        Args:
            pipeline: the pipeline called.
            payload: the validated request.
            sent: its headers (time budget, trace id, lane).
            request_id: the id to use (default: a fresh one).
            stream: ask the worker for partial output as it is produced.
            job: an async job: its record is created with the request, and the result is
                stored there instead of sent to this gateway.
            owner: who submits it (the API key's identity): only they can read the job.

        Raises:
            InvalidInput: the payload holds what an envelope cannot carry (see
                :func:`~pipelines.envelope.wire_problem`); nothing was enqueued.
            Overloaded: the entry stage's backlog (both lanes) is at its bound, or the
                request would miss its deadline (nothing was enqueued).
            Unavailable: Redis cannot be reached, or this gateway is draining
                (:meth:`drain`); nothing was enqueued.
        """
        self._check(payload)
        timeout_s = self.timeout_for(sent.timeout_s, job=job)
        spans = traces.Enqueueing(self.clock)
        await self._admit(pipeline.entry.stage, timeout_s, sent.lane)
        spans.admission(sent.lane)
        request_id = request_id or new_request_id()
        keys = self.keys.of(request_id)  # the partition of everything it touches
        ctx = {"input": payload}
        request = Request(
            id=request_id,
            pipeline=pipeline.name,
            stage=pipeline.entry.stage.name,
            step=pipeline.entry.name,
            payload=pipeline.input_of(pipeline.entry, ctx, None),
            state=ctx,
            deadline=self.clock.now() + timeout_s,
            reply_to=keys.job(request_id) if job else self.reply_streams[keys.partition],
            trace_id=spans.trace_id(sent.trace) or new_request_id(),
            stream=stream,
            enqueue_by=self.writer.enqueue_by(),
            lane=sent.lane,
            traceparent=spans.traceparent(),
            reply_batches=not job,  # its reply stream's reader takes several an entry
        )
        await self.writer.write(request, timeout_s, owner if job else None)
        spans.enqueued(request)
        return request

    def _check(self, payload: dict[str, Any]) -> None:
        """Refuse a request before anything else: this gateway is draining, or its payload
        holds what an envelope cannot carry."""
        if self.draining:
            raise Unavailable("this gateway is stopping; retry", self.settings.retry_after_s)
        problem = wire_problem(payload)
        if problem is not None:
            # What the body parser let through can still be changed by validation (a
            # float field reads the string "inf"): the payload as it would be sent decides.
            raise InvalidInput(f"invalid request: {problem.msg}", [problem_detail(problem)])

    async def _admit(self, stage: Stage, timeout_s: float, lane: Lane) -> None:
        """Admit a request to ``stage`` (:class:`~gateway.admission.Admission`), on a
        calibrated clock."""
        bound = self.settings.max_backlog or stage.max_backlog
        # Calibrated, and decided on the view at hand (the common case): nothing is
        # awaited, so no deadline needs arming (a timer per request, and its cancel).
        calibrated = self.misconfigured is None and math.isfinite(self.clock.error)
        if calibrated and self.admission.admit_now(
            stage.name, bound, timeout_s, stage.max_batch_size, lane
        ):
            return
        try:
            # Within the request's own time: a stalled Redis does not hold a call given
            # 1 s for the client's whole command timeout (2 s) before its 503.
            async with asyncio.timeout(timeout_s):
                await self._calibrated()
                await self.admission.admit(stage.name, bound, timeout_s, stage.max_batch_size, lane)
        except TimeoutError:
            raise refusal(RedisTimeoutError(f"no answer within {timeout_s:g}s")) from None
        except REDIS_DOWN as exc:
            raise refusal(exc) from exc

    async def _calibrated(self) -> None:
        """Measure the Redis clock now if it never was (Redis was down at start): deadlines
        and enqueue_by are on it; and check the partition count, as :meth:`start` would
        have. Concurrent requests share one measurement.

        Raises:
            Unavailable: this gateway's partition count is not the namespace's (said in
                the log and by ``/readyz`` too; it serves nothing until restarted right).
        """
        if self.misconfigured is not None:
            raise Unavailable(self.misconfigured, self.settings.retry_after_s)
        if math.isfinite(self.clock.error):
            return
        if self._calibrating is None or self._calibrating.done():
            self._calibrating = asyncio.create_task(self._join())
        await asyncio.shield(self._calibrating)

    async def _join(self) -> None:
        await self.clock.calibrate(self.client)
        try:
            await agree_on_partitions(self.client, self.keys)
        except ConfigError as exc:
            logger.error("%s", exc)
            self.misconfigured = f"this gateway is misconfigured: {exc}"
            raise Unavailable(self.misconfigured, self.settings.retry_after_s) from None

    async def call(
        self,
        pipeline: Pipeline,
        payload: dict[str, Any],
        sent: Sent,
        receive: Receive,
        disconnect: Disconnect | None = None,
    ) -> tuple[str, Reply]:
        """Run one request through ``pipeline`` and wait for its reply.

        Args:
            pipeline: the pipeline called.
            payload: the validated request.
            sent: its headers (time budget, trace id, lane).
            receive: the HTTP request's ASGI receive, its body read: if the client
                disconnects while the reply is awaited, the request is cancelled.
            disconnect: the request's scope's :class:`~gateway.protocol.Disconnect`,
                where the server gives one: the disconnect is learnt from it instead
                (see :func:`~gateway.cancel.watch`).

        Returns:
            The request id and the reply.

        Raises:
            Overloaded: the entry stage's backlog is at its bound (nothing was enqueued).
            Unavailable: Redis cannot be reached.
            DeadlineExceeded: no reply within its time budget, or within the drain
                (:meth:`drain`).
            Cancelled: the client went away first (nobody reads the answer).
        """
        request_id = new_request_id()
        future = self.replies.expect(request_id)
        held = [future]  # let go once the call is over: its alarm may stay in the heap a while
        watcher = None
        try:
            request = await self.enqueue(pipeline, payload, sent, request_id=request_id)
            watcher = watch(receive, future, request_id, disconnect)
            timeout_s = self.timeout_for(sent.timeout_s)
            # Awaited directly (no wait_for task hop, no timeout scope to cancel and
            # uncancel this task): the reply wakes this handler in the loop iteration after
            # it is dispatched, and the deadline fails the future itself (on the shared
            # alarm timer: no timer of its own, armed and cancelled, per call).
            loop = asyncio.get_running_loop()
            self.alarms.at(
                loop, loop.time() + timeout_s, partial(_moot, held), partial(_expire, held)
            )
            try:
                reply = await future
            except _Expired:
                raise DeadlineExceeded(
                    f"no result within {timeout_s:g}s", request_id=request.id
                ) from None
            except ClientGone:
                await self.cancellations.mark(request.id, request.deadline)
                raise Cancelled("the client went away", request_id=request.id) from None
            except Abandoned as exc:  # the drain ran out (see drain())
                await self.cancellations.mark(request.id, request.deadline)
                raise DeadlineExceeded(str(exc), request_id=request.id) from None
            root = traces.current()
            written = self.replies.written.pop(request_id, None)
            if root is not None and written is not None:
                now = self.clock.now()  # a reply id ahead of the clock tells no time
                stage = {"conveyor.stage": reply.stage}
                traces.child(root, "reply", min(written, now), now, **stage)
        finally:
            held.clear()
            self.replies.forget(request_id)
            if watcher is not None:
                await unwatch(watcher)
        return request.id, reply

    async def job(self, job_id: str, owner: str = ANONYMOUS) -> dict[str, Any]:
        """An async job's status, and its result or error once finished.

        Args:
            job_id: the job.
            owner: who asks (the API key's identity); another's job is not found.

        Raises:
            NotFound: no such job (never submitted, expired after ``job_ttl_s``, or
                submitted under another key: existence does not leak).
        """
        return (await self._record(job_id, owner)).view(job_id, self.clock.now())

    async def cancel_job(self, job_id: str, owner: str = ANONYMOUS) -> tuple[bool, dict[str, Any]]:
        """Cancel an async job (see :meth:`Cancellations.cancel_job
        <gateway.cancel.Cancellations.cancel_job>`).

        Args:
            job_id: the job.
            owner: who asks; only the job's owner may cancel it.

        Returns:
            Whether it was cancelled now (False: it had already finished), and its view.

        Raises:
            NotFound: as :meth:`job` (nothing is marked).
        """
        return await self.cancellations.cancel_job(job_id, await self._record(job_id, owner))

    async def _record(self, job_id: str, owner: str) -> JobRecord:
        try:
            raw = await on_live_connection(
                self.client, lambda: self.client.hgetall(self.keys.of(job_id).job(job_id))
            )
        except REDIS_DOWN as exc:
            raise refusal(exc) from exc
        record = JobRecord.parse(raw)
        if not record.readable_by(owner):
            raise NotFound(f"no job {job_id!r} (never submitted, or expired)")
        return record


class _Expired(Exception):
    """A sync call's deadline passed before its reply came."""


def _moot(held: list[asyncio.Future[Reply]]) -> bool:
    return not held or held[0].done()


def _expire(held: list[asyncio.Future[Reply]]) -> None:
    if not _moot(held):
        held[0].set_exception(_Expired())


def _surface(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("reply dispatcher died", exc_info=task.exception())
