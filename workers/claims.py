"""Who holds an entry: the "on the model" marks a crash is charged by, the lease that
keeps a running batch's entries from looking idle, and taking back idle entries.

A batch's entries are marked on the model before user code runs them (:func:`mark`: one
HSET a batch into a hash per stream, by entry id); its publish deletes the marks with its
ack, so a process that dies leaves its marks behind. A mark names the batch it was on the
model in: its size and first entry id (``<size>:<id>``; ``h`` first if its call hung).
Whoever reclaims the entries reads them (:func:`sort_out`): no mark, the entry was only
waiting and is taken back uncharged (XAUTOCLAIM ``JUSTID``); a batch's mark, the crash
is charged to it (XCLAIM counts a delivery); a queued mark (``q`` first), charged by an
earlier crash and still waiting for its re-run. What to do with them (run the batch
again, halve it, dead-letter) is :mod:`workers.recovery`'s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pipelines.keys import GROUP, Keys
from runtime.packing import pipelined
from runtime.redisio import REDIS_DOWN, group_missing, text
from workers.values import Claimed, Entry, by_stream

logger = logging.getLogger(__name__)

MARK_TTL_S = 86_400
"""A hash of marks outlives any wait for a reclaim (a parked stage's back-off included):
its expiry is pushed back at least every :data:`MARK_REFRESH_S` while it is written."""

MARK_REFRESH_S = 3600.0

_refreshed: dict[str, float] = {}
"""When this process last pushed back each hash of marks' expiry (monotonic)."""

QUEUED = b"q"
"""The prefix of the mark of an entry charged by an earlier crash, waiting for its re-run."""

HUNG = b"h"
"""The prefix of the mark of an entry whose batch's model call hung (after ``q``, if any)."""


def batch_mark(entries: Sequence[Entry]) -> bytes:
    """The mark of ``entries`` on the model as one batch: its size and first entry id."""
    return b"%d:%s" % (len(entries), entries[0].id if entries else b"")


def parse_mark(value: bytes) -> tuple[bool, bool, int, bytes]:
    """(queued, hung, the size of the batch it crashed in, that batch's first entry id)
    of a mark; a mark of an older worker (``5``, ``q``) reads as a batch of its own."""
    queued = value.startswith(QUEUED)
    rest = value.removeprefix(QUEUED)
    hung = rest.startswith(HUNG)
    size, _, token = rest.removeprefix(HUNG).partition(b":")
    return queued, hung, int(size) if size.isdigit() and int(size) > 0 else 1, token


def marks(keys: Keys, entries: Sequence[Entry]) -> dict[str, list[bytes]]:
    """The on-model marks of ``entries``, by the hash each is in (what their batch's
    publish deletes)."""
    return {keys.on_model(stream): ids for stream, ids in by_stream(entries).items()}


def mark(keys: Keys, entries: Sequence[Entry], value: bytes | None = None) -> list[list[Any]]:
    """The commands that mark ``entries``: on the model as one batch (:func:`batch_mark`),
    or ``value``; one HSET per stream (and, now and then, an EXPIRE)."""
    what = batch_mark(entries) if value is None else value
    commands: list[list[Any]] = []
    now = time.monotonic()
    for key, ids in marks(keys, entries).items():
        hset: list[Any] = ["HSET", key]
        for eid in ids:
            hset += (eid, what)
        commands.append(hset)
        if now - _refreshed.get(key, -math.inf) > MARK_REFRESH_S:
            _refreshed[key] = now
            commands.append(["EXPIRE", key, MARK_TTL_S])
    return commands


async def mark_hung(client: aioredis.Redis, keys: Keys, entries: Sequence[Entry]) -> None:
    """Mark ``entries`` as on the model in a call that hung (``h<size>:<id>``)."""
    await pipelined(client, mark(keys, entries, HUNG + batch_mark(entries)), raise_on_error=True)


async def mark_now(client: aioredis.Redis, keys: Keys, entries: Sequence[Entry]) -> None:
    """Mark ``entries`` on the model in a round trip of its own (before a staged model's
    host phase, which runs before the batch's turn)."""
    await pipelined(client, mark(keys, entries), raise_on_error=True)


async def claim_idle(
    client: aioredis.Redis,
    keys: Keys,
    stream: str,
    consumer: str,
    min_idle_ms: int,
    count: int,
    held: Collection[bytes] = (),
) -> Claimed:
    """Take up to ``count`` entries of ``stream`` idle for ``min_idle_ms`` from any
    consumer, charging a delivery only to those its marks say were on the model.

    Entries this process is running now (``held``: its leases') are left alone: they
    look idle only because their lease could not touch them in time (a loaded host, an
    idle time set shorter than a touch takes), and taking them back would run them
    twice here, charging a crash that never happened. XAUTOCLAIM ``JUSTID`` counts no
    delivery, so they come out of it as they went in, theirs again.

    Entries deleted from the stream while pending are dropped from the group by the
    server (XAUTOCLAIM's third list); nothing is left to do for them.
    """
    ids = await client.xautoclaim(
        stream, GROUP, consumer, min_idle_ms, "0-0", count=count, justid=True
    )
    taken = [eid for eid in map(_raw, ids) if eid not in held]
    return await sort_out(client, keys, stream, consumer, taken)


async def own_pending(client: aioredis.Redis, keys: Keys, stream: str, consumer: str) -> Claimed:
    """The entries ``consumer`` (a restarted worker under a stable name) still holds on
    ``stream``, sorted by their marks as :func:`claim_idle` does. The consumer joins the
    group here, before its first read (what ``up`` and ``/status`` see of a worker that
    has loaded its model and reads, even while nothing arrives)."""
    await client.xgroup_createconsumer(stream, GROUP, consumer)
    rows = await client.xpending_range(
        stream, GROUP, min="-", max="+", count=10_000, consumername=consumer
    )
    ids = [_raw(row["message_id"]) for row in rows]
    return await sort_out(client, keys, stream, consumer, ids)


async def sort_out(
    client: aioredis.Redis, keys: Keys, stream: str, consumer: str, ids: list[bytes]
) -> Claimed:
    """Read the marks of ``ids`` (held by ``consumer``), charge one delivery to each
    that was on the model (XCLAIM) and mark it queued (what it crashed in is kept), and
    fetch the others' fields without charging them."""
    if not ids:
        return Claimed()
    key = keys.on_model(stream)
    found = await client.hmget(key, ids)
    out = Claimed()
    read = {i: m for i, m in zip(ids, found, strict=True) if isinstance(m, bytes)}
    for eid, value in read.items():
        _, hung, size, token = parse_mark(value)
        out.crashed_in[eid] = (size, token)
        if hung:
            out.hung.add(eid)
    on_model: list[Any] = [i for i, m in read.items() if not m.startswith(QUEUED)]
    queued = {i for i, m in read.items() if m.startswith(QUEUED)}
    if on_model:
        # Queued first: a worker dying between the two leaves them to run again, never
        # charged twice for one crash.
        await client.hset(key, mapping={eid: QUEUED + read[eid] for eid in on_model})
        taken = cast(list[Any], await client.xclaim(stream, GROUP, consumer, 0, list(on_model)))
        out.charged = [Entry(_raw(e), f, stream) for e, f in taken if f]
    others = [i for i in ids if i not in set(on_model)]
    if others:
        pipe = client.pipeline(transaction=False)
        for eid in others:
            pipe.xrange(stream, eid, eid, count=1)
        for eid, got in zip(others, await pipe.execute(), strict=True):
            if got and got[0][1]:
                entry = Entry(eid, cast(dict[bytes, bytes], got[0][1]), stream)
                (out.queued if eid in queued else out.waiting).append(entry)
    return out


def _raw(eid: object) -> bytes:
    return eid if isinstance(eid, bytes) else str(eid).encode()


async def deliveries(
    client: aioredis.Redis, stream: str, consumer: str, ids: Sequence[bytes]
) -> dict[bytes, int]:
    """How many times each of ``ids`` (owned by ``consumer``) has been delivered."""
    if not ids:
        return {}
    ordered = sorted(ids, key=_id_key)
    rows = await client.xpending_range(
        stream,
        GROUP,
        min=ordered[0],
        max=ordered[-1],
        count=len(ids) * 2 + 16,
        consumername=consumer,
    )
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


class Lease:
    """A running batch's hold on its entries: touches them every ``interval_s`` while it
    runs (see :func:`touch`).

    Nothing runs until the first interval has passed (most batches end well before), and
    the touching loop is stopped by an event, never cancelled mid-command.

    Args:
        client: Redis client.
        acks: the batch's entry ids, by the stream (lane) each came from.
        consumer: this worker's consumer name.
        interval_s: seconds between touches (well under the reclaim idle time).
        held: the ids this process holds now, by how many leases hold each: the lease's
            are counted in until it stops (:func:`claim_idle` never takes them back).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        acks: Mapping[str, Sequence[bytes]],
        consumer: str,
        interval_s: float,
        held: Counter[bytes] | None = None,
    ) -> None:
        self.client, self.acks, self.consumer = client, acks, consumer
        self.interval_s = interval_s
        self._held = held
        if held is not None:
            held.update(eid for ids in acks.values() for eid in ids)
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
        held, self._held = self._held, None
        if held is not None:  # once, whatever the loop's end raises
            for eid in (eid for ids in self.acks.values() for eid in ids):
                held[eid] -= 1
                if held[eid] <= 0:
                    del held[eid]
        if self._task is not None:
            await self._task
