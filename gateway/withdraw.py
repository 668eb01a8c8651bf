"""Withdrawing a request the gateway refused after its write went unanswered.

The client was told 503, so the request must not take effect; but the write may still land
(Redis stalled, not gone). A worker drops such an entry (it arrives after its
``enqueue_by``), yet a job's record would stay behind, "queued" under an id nobody was
given. So, in the background until Redis answers (at most until the request's deadline has
long passed), the record is deleted and the entry step's done marker set, which also stops a
publish (workers/publish.py) should the write have landed just before the gateway gave up.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from gateway.background import Background
from pipelines.envelope import Request
from pipelines.keys import Keys
from pipelines.redisio import REDIS_DOWN, RedisClock, in_order

logger = logging.getLogger(__name__)

MAX_WITHDRAWALS = 10_000
"""Refused requests being withdrawn at once, at most (each waits for Redis to answer)."""


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
                    pipe.set(marker, "withdrawn", ex=ttl)
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
