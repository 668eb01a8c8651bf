"""The gateway's core: admit a request, enqueue it, await its reply."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.admission import Admission
from gateway.edge import RequestMetrics
from gateway.replies import ReplyDispatcher
from gateway.settings import GatewaySettings
from pipelines.envelope import Reply, Request, encode, new_request_id
from pipelines.errors import DeadlineExceeded, Unavailable
from pipelines.graph import Pipeline, Registry
from pipelines.redisio import RedisClock, connect

logger = logging.getLogger(__name__)

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)


class Gateway:
    """Everything one gateway process holds: connections, reply loop, admission.

    Args:
        settings: the gateway's settings.
        stages: the stages it routes, by name.
    """

    def __init__(self, settings: GatewaySettings, registry: Registry) -> None:
        self.settings = settings
        self.registry = registry
        self.keys = settings.keys
        self.gateway_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.reply_stream = self.keys.reply_stream(self.gateway_id)
        self.clock = RedisClock()
        self.metrics = RequestMetrics()
        self.client: aioredis.Redis = connect(settings)
        self._reader = connect(settings, block_ms=settings.reply_block_ms)
        self.replies = ReplyDispatcher(self._reader, self.reply_stream, settings.reply_block_ms)
        self.admission = Admission(
            self.client,
            self.keys,
            settings.admission_refresh_ms / 1000.0,
            settings.retry_after_s,
        )
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the reply loop; Redis being down is not fatal (requests get 503)."""
        try:
            await self.clock.calibrate(self.client)
        except REDIS_DOWN as exc:
            logger.warning("redis unreachable at start (%s); serving 503 until it is back", exc)
        self._task = asyncio.create_task(self.replies.run(), name="reply-dispatcher")
        self._task.add_done_callback(_surface)
        logger.info("gateway %s routing %s", self.gateway_id, ", ".join(self.registry.pipelines))

    async def stop(self) -> None:
        """Stop the reply loop and close connections."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:  # nobody will read it again; without this it lingers until its TTL
            await self.client.delete(self.reply_stream)
        except REDIS_DOWN as exc:
            logger.warning("reply stream %s left to expire: %s", self.reply_stream, exc)
        await self._reader.aclose()
        await self.client.aclose()

    def timeout_for(self, asked: float | None) -> float:
        """The request's time budget: what it asked for, within the bounds."""
        if asked is None:
            return self.settings.default_timeout_s
        return min(asked, self.settings.max_timeout_s)

    async def ready(self) -> bool:
        """Whether Redis answers (a stage with no worker is not a readiness failure)."""
        try:
            return bool(await self.client.ping())
        except REDIS_DOWN:
            return False

    async def enqueue(
        self,
        pipeline: Pipeline,
        payload: dict[str, Any],
        timeout_s: float,
        trace_id: str | None,
        *,
        reply_to: str | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Admit a request and put it on its entry step's stream.

        Args:
            pipeline: the pipeline called.
            payload: the validated request.
            timeout_s: the request's time budget.
            trace_id: the caller's trace id, if any.
            reply_to: where the result goes (default: this gateway's reply stream).
            request_id: the id to use (default: a fresh one).

        Raises:
            Overloaded: the entry stage's backlog is at its bound (nothing was enqueued).
            Unavailable: Redis cannot be reached.
        """
        entry = pipeline.entry
        bound = self.settings.max_backlog or entry.stage.max_backlog
        try:
            await self.admission.admit(entry.stage.name, bound)
        except REDIS_DOWN as exc:
            raise Unavailable("the queue is unreachable; retry shortly", 1.0) from exc
        ctx = {"input": payload}
        request = Request(
            id=request_id or new_request_id(),
            pipeline=pipeline.name,
            stage=entry.stage.name,
            step=entry.name,
            payload=pipeline.input_of(entry, ctx, None),
            state=ctx,
            deadline=self.clock.now() + timeout_s,
            reply_to=reply_to or self.reply_stream,
            trace_id=trace_id or new_request_id(),
        )
        try:
            await self.client.xadd(self.keys.stage_stream(entry.stage.name), encode(request))
        except REDIS_DOWN as exc:
            raise Unavailable("the queue is unreachable; retry shortly", 1.0) from exc
        return request

    async def call(
        self, pipeline: Pipeline, payload: dict[str, Any], timeout_s: float, trace_id: str | None
    ) -> tuple[str, Reply]:
        """Run one request through ``pipeline`` and wait for its reply.

        Returns:
            The request id and the reply.

        Raises:
            Overloaded: the entry stage's backlog is at its bound (nothing was enqueued).
            Unavailable: Redis cannot be reached.
            DeadlineExceeded: no reply within ``timeout_s``.
        """
        request_id = new_request_id()
        future = self.replies.expect(request_id)
        try:
            request = await self.enqueue(
                pipeline, payload, timeout_s, trace_id, request_id=request_id
            )
            try:
                reply = await asyncio.wait_for(future, timeout_s)
            except TimeoutError:
                raise DeadlineExceeded(
                    f"no result within {timeout_s:g}s", request_id=request.id
                ) from None
        finally:
            self.replies.forget(request_id)
        return request.id, reply


def _surface(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("reply dispatcher died", exc_info=task.exception())
