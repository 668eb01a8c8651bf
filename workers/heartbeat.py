"""Keeping a running batch's entries fresh, so a slow worker is not robbed.

Entries pending longer than ``min_idle_ms`` are reclaimed by another worker
(:mod:`workers.recovery`). A worker still running a long batch touches its entries
(XCLAIM JUSTID, only those it still owns, atomically) so they never look idle: on each
stream (lane) its batch's entries came from.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pipelines.keys import GROUP
from runtime.redisio import REDIS_DOWN, group_missing

logger = logging.getLogger(__name__)

TOUCH_SCRIPT = """
-- KEYS[1]: stream; ARGV[1]: group, ARGV[2]: consumer, ARGV[3..]: entry ids.
-- Resets the idle time of the entries this consumer still owns; never takes one back
-- from a worker that has reclaimed it meanwhile. Returns how many were touched.
local touched = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    touched = touched + 1
  end
end
return touched
"""


async def touch(client: aioredis.Redis, stream: str, consumer: str, ids: Sequence[bytes]) -> int:
    """Keep ``ids`` (those ``consumer`` still owns) from looking idle."""
    if not ids:
        return 0
    touched = await client.eval(TOUCH_SCRIPT, 1, stream, GROUP, consumer, *ids)
    return int(touched)


class Heartbeat:
    """Touches a batch's entries every ``interval_s`` while it runs (see :func:`touch`).

    Nothing runs until the first interval has passed (most batches end well before), and
    the touching loop is stopped by an event, never cancelled mid-command.

    Args:
        client: Redis client.
        acks: the batch's entry ids, by the stream (lane) each came from.
        consumer: this worker's consumer name.
        interval_s: seconds between touches (well under the reclaim idle time).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        acks: Mapping[str, Sequence[bytes]],
        consumer: str,
        interval_s: float,
    ) -> None:
        self.client, self.acks, self.consumer = client, acks, consumer
        self.interval_s = interval_s
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(interval_s, self._begin)

    def _begin(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                for stream, ids in self.acks.items():
                    await touch(self.client, stream, self.consumer, ids)
            except REDIS_DOWN as exc:
                logger.warning("could not refresh in-flight entries: %s", exc)
            except ResponseError as exc:
                if not group_missing(exc):
                    raise
                # The group is gone (Redis came back empty): nothing of ours is pending to
                # keep; the batch still publishes, and the read loop re-creates the group.
                logger.warning("could not refresh in-flight entries: %s", exc)
                return
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
                return
            except TimeoutError:
                pass

    async def stop(self) -> None:
        """Stop touching and wait for the loop to end."""
        self._timer.cancel()
        self._stop.set()
        if self._task is not None:
            await self._task
