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

from pipelines.envelope import Request
from pipelines.keys import Keys
from pipelines.redisio import REDIS_DOWN, RedisClock

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
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, request: Request, timeout_s: float) -> None:
        """Withdraw ``request`` (refused with ``timeout_s`` as its budget) in the background."""
        if len(self._tasks) >= MAX_WITHDRAWALS:
            logger.warning(
                "request %s refused but not withdrawn: %d withdrawals pending",
                request.id,
                len(self._tasks),
            )
            return
        # Only what the withdrawal needs is kept, not the request (its payload can be a MiB).
        rid, marker = request.id, self.keys.done(request.id, request.step)
        job = request.reply_to if request.reply_to.startswith(self.keys.job_prefix) else None
        ttl = int(timeout_s) + 120  # past anything a worker could still publish for it
        until = request.deadline + 60

        async def withdraw() -> None:
            while self.clock.now() < until:
                try:
                    pipe = self.client.pipeline(transaction=True)
                    pipe.set(marker, "withdrawn", ex=ttl)
                    if job is not None:
                        pipe.delete(job)
                    await pipe.execute()
                    return
                except REDIS_DOWN as exc:
                    logger.debug("request %s: withdrawal waits for redis: %s", rid, exc)
                    await asyncio.sleep(0.5)

        task = asyncio.create_task(withdraw(), name=f"withdraw-{rid}")
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # e.g. NOPERM from an ACL without +set: the request may still take effect.
            logger.error("a withdrawal failed", exc_info=task.exception())

    async def abandon(self) -> None:
        """Stop every pending withdrawal (the process is stopping), saying how many."""
        if self._tasks:
            logger.warning(
                "%d refused request(s) left unwithdrawn at stop; their writes may still take "
                "effect",
                len(self._tasks),
            )
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
