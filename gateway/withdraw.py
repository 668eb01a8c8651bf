"""Settling a request whose write went unanswered, and withdrawing it.

The write may have landed (its answer lost, or Redis stalled, not gone). Its entry
step's done marker decides what came first: a worker's publish sets it only if absent,
and so does a withdrawal (``withdrawn``), which reads it back in the same round trip. So
before the client is answered, :meth:`Withdrawals.settle` learns whether the request is
withdrawn (nothing of it takes effect, its job record is deleted: a 503 is true) or ran
(the client gets its answer). Only when Redis does not answer within the write's time
is the client told 503 unsettled, and the withdrawal goes on in the background until
Redis answers (deploy/README.md says how rare a publish that still comes first is).
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from gateway.background import Background
from pipelines.envelope import Request
from pipelines.keys import Keys
from runtime.redisio import REDIS_DOWN, RedisClock, in_order, text

logger = logging.getLogger(__name__)

MAX_WITHDRAWALS = 10_000
"""Refused requests being withdrawn at once, at most (each waits for Redis to answer)."""

WITHDRAWN = "withdrawn"
"""The value of a done marker the gateway set (a worker's publish sets ``1``)."""

SETTLE_RETRY_S = 0.1
"""How soon an unanswered settling is tried again (the client is waiting)."""


def _refused(exc: BaseException) -> bool:
    """Whether a connection was refused under ``exc``: nothing listens there now (the node
    is down), so waiting for it within a request's time would only delay the answer."""
    seen: BaseException | None = exc
    for _ in range(16):  # a chain of causes, bounded
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class Withdrawals:
    """The withdrawals of one gateway process, each a background task.

    Args:
        client: the gateway's Redis client.
        keys: key names.
        clock: the Redis clock (deadlines are on it).
    """

    def __init__(self, client: aioredis.Redis, keys: Keys, clock: RedisClock) -> None:
        self.client = client
        self.keys = keys
        self.clock = clock
        self._pending = Background("withdrawal", MAX_WITHDRAWALS)

    async def settle(self, request: Request, timeout_s: float, within_s: float) -> bool | None:
        """Whether ``request``, whose write went unanswered, is withdrawn (True) or ran
        (False: its entry step published before the withdrawal), asked of Redis for at
        most ``within_s`` seconds; None when Redis did not answer (the withdrawal then
        goes on in the background, :meth:`start`).

        Args:
            request: the request whose write went unanswered.
            timeout_s: its time budget.
            within_s: how long to keep asking (a connection refused stops it at once).
        """
        keys = self.keys.of(request.id)
        marker, ttl = keys.done(request.id, request.step), int(timeout_s) + 120
        give_up = time.monotonic() + within_s
        while True:
            try:
                pipe = in_order(self.client)
                pipe.set(marker, WITHDRAWN, ex=ttl, nx=True)
                pipe.get(marker)
                _, value = await pipe.execute()
                break
            except REDIS_DOWN as exc:
                if _refused(exc) or time.monotonic() + SETTLE_RETRY_S > give_up:
                    logger.warning("request %s: unsettled (%s); withdrawing it", request.id, exc)
                    self.start(request, timeout_s)
                    return None
                logger.debug("request %s: settling waits for redis: %s", request.id, exc)
                await asyncio.sleep(SETTLE_RETRY_S)
        if value is not None and text(value) != WITHDRAWN:
            logger.info("request %s: its write landed and ran; answered", request.id)
            return False
        if request.reply_to.startswith(keys.job_prefix):
            try:  # "queued" under an id nobody was given
                await self.client.delete(request.reply_to)
            except REDIS_DOWN:
                self.start(request, timeout_s)
        return True

    def start(self, request: Request, timeout_s: float) -> None:
        """Withdraw ``request`` (refused with ``timeout_s`` as its budget) in the background."""
        # Only what the withdrawal needs is kept, not the request (its payload can be a MiB).
        keys = self.keys.of(request.id)
        rid, marker = request.id, keys.done(request.id, request.step)
        job = request.reply_to if request.reply_to.startswith(keys.job_prefix) else None
        ttl = int(timeout_s) + 120  # past anything a worker could still publish for it
        until = request.deadline + 60

        async def withdraw() -> None:
            while self.clock.now() < until:
                try:
                    pipe = in_order(self.client)
                    # Only if absent: a worker's publish that came first keeps its marker.
                    pipe.set(marker, WITHDRAWN, ex=ttl, nx=True)
                    if job is not None:
                        pipe.delete(job)
                    await pipe.execute()
                    return
                except REDIS_DOWN as exc:
                    logger.debug("request %s: withdrawal waits for redis: %s", rid, exc)
                    await asyncio.sleep(0.5)

        self._pending.start(rid, withdraw())

    async def abandon(self) -> None:
        """Stop every pending withdrawal (the process is stopping), saying how many."""
        if self._pending:
            logger.warning(
                "%d refused request(s) left unwithdrawn at stop; their writes may still take "
                "effect",
                len(self._pending),
            )
        await self._pending.cancel()
