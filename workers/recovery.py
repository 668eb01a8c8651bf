"""Delivery guarantees: reclaiming idle entries, keeping live ones fresh, the delivery
cap, dead letters, and trimming a stream without losing anything.

- A worker that dies leaves its entries pending; after ``min_idle_ms`` another worker
  (or the same one, restarted) takes them with XAUTOCLAIM.
- A worker still running a long batch touches its entries (XCLAIM JUSTID, only those it
  still owns, atomically) so they never look idle: a slow worker is not robbed.
- An entry delivered more than ``max_deliveries`` times goes to the stage's dead-letter
  stream instead of running again; its client is told at once.
- The stream is trimmed below the oldest entry still pending or not yet delivered, so
  trimming never deletes work.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis.typing import EncodableT, FieldT

from pipelines.keys import GROUP
from pipelines.records import DeadLetter
from pipelines.redisio import REDIS_DOWN, group_missing, text

logger = logging.getLogger(__name__)

Entry = tuple[bytes, dict[bytes, bytes]]

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


async def autoclaim(
    client: aioredis.Redis, stream: str, consumer: str, min_idle_ms: int, count: int
) -> list[Entry]:
    """Take up to ``count`` entries idle for ``min_idle_ms`` from any consumer.

    Entries deleted from the stream while pending (XAUTOCLAIM's third list) are dropped
    from the group by the server; nothing is left to do for them.
    """
    reply = await client.xautoclaim(stream, GROUP, consumer, min_idle_ms, "0-0", count=count)
    entries: list[Entry] = [(eid, fields) for eid, fields in reply[1] if fields is not None]
    return entries


async def deliveries(
    client: aioredis.Redis, stream: str, consumer: str, ids: Sequence[bytes]
) -> dict[bytes, int]:
    """How many times each of ``ids`` (owned by ``consumer``) has been delivered."""
    if not ids:
        return {}
    ordered = sorted(ids, key=_id_key)
    rows = await client.xpending_range(
        stream, GROUP, min=ordered[0], max=ordered[-1], count=len(ids) * 2 + 16,
        consumername=consumer,
    )  # fmt: skip
    wanted = set(ids)
    out: dict[bytes, int] = {}
    for row in rows:
        eid = row["message_id"]
        eid = eid if isinstance(eid, bytes) else str(eid).encode()
        if eid in wanted:
            out[eid] = int(row["times_delivered"])
    return out


def _id_key(eid: bytes) -> tuple[int, int]:
    ms, _, seq = eid.decode().partition("-")
    return int(ms), int(seq or 0)


async def trim(client: aioredis.Redis, stream: str) -> int:
    """Trim entries below the oldest one still pending or not yet delivered.

    Returns:
        How many entries the server deleted (approximate trimming deletes whole nodes).
    """
    try:
        groups = await client.xinfo_groups(stream)
    except ResponseError:
        return 0
    group = next((g for g in groups if text(g["name"]) == GROUP), None)
    if group is None:
        return 0
    floor = text(group["last-delivered-id"])
    if floor in ("0-0", "0"):
        return 0
    summary = await client.xpending(stream, GROUP)
    if summary["pending"]:
        oldest = text(summary["min"])
        floor = min(floor, oldest, key=lambda i: _id_key(i.encode()))
    deleted = await client.xtrim(stream, minid=floor, approximate=True)
    return int(deleted)


class Heartbeat:
    """Touches a batch's entries every ``interval_s`` while it runs (see :func:`touch`).

    Nothing runs until the first interval has passed (most batches end well before), and
    the touching loop is stopped by an event, never cancelled mid-command.

    Args:
        client: Redis client.
        stream: the stage stream.
        consumer: this worker's consumer name.
        ids: the batch's entry ids.
        interval_s: seconds between touches (well under the reclaim idle time).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        stream: str,
        consumer: str,
        ids: Sequence[bytes],
        interval_s: float,
    ) -> None:
        self.args = (client, stream, consumer, ids)
        self.interval_s = interval_s
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(interval_s, self._begin)

    def _begin(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await touch(*self.args)
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


async def leave_group(client: aioredis.Redis, stream: str, consumer: str) -> bool:
    """After a drain, remove ``consumer`` from the group if it holds nothing pending.

    Returns:
        Whether it was removed.
    """
    mine = await client.xpending_range(stream, GROUP, min="-", max="+", count=1,
                                       consumername=consumer)  # fmt: skip
    if mine:
        return False
    await client.xgroup_delconsumer(stream, GROUP, consumer)
    return True


def letter(
    entry_id: bytes, fields: dict[bytes, bytes], deliveries: int, error: str
) -> dict[FieldT, EncodableT]:
    """A dead-letter entry: the original fields (envelope untouched, so it can be
    replayed) plus where it came from, how often it was delivered, and why it stopped."""
    out: dict[FieldT, EncodableT] = {k: v for k, v in fields.items()}
    out.update(DeadLetter(entry_id, deliveries, error).fields())
    return out
