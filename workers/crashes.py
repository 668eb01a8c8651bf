"""What a worker's crash is charged to: the entries that were in the model's hands.

A model can end its process: a segfault, ``os._exit``, the OOM killer on one huge input,
a call that hangs until the worker is restarted. Before a batch's items reach a user's
code the worker marks each of its entries "on the model" (:meth:`Keys.on_model`, one
``SET`` each, sent in the round trip the batch makes anyway at its turn); the batch's
publish deletes the marks with its ack. A process that dies leaves its marks behind, and
whoever reclaims its entries (:class:`~workers.recovery.Recovery`) reads them:

- **no mark**: the entry was only waiting (read, in a window, in a batch not yet on the
  model) when its worker died. It is claimed without counting a delivery (XAUTOCLAIM
  ``JUSTID``) and runs in an ordinary batch of those taken back, before anything new is
  read: a worker killed again and again charges nothing to the entries it merely held.
- **a number** (the size of the batch it was in): the crash is charged to it. It counts
  one delivery (XCLAIM) and runs alone, once nothing else of its worker is in flight, so
  a crash while it runs is its own; past
  ``CONVEYOR_MAX_DELIVERIES`` it is dead-lettered. Its batch-mates were charged too,
  once, and each also runs alone: the input that kills is found with one more crash, not
  one per halving (a crash costs a restart and a reload, seconds; an item alone costs one
  model call).
- **queued** (:data:`QUEUED`): charged by an earlier crash, and waiting to run alone when
  this one came: still run alone, not charged again.

So ``CONVEYOR_MAX_DELIVERIES`` counts the crashes an entry was on the model for, plus its
first read: a poison input is dead-lettered after that many crashes, and no entry is
dead-lettered for crashes it did not run in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis

from pipelines.keys import GROUP, Keys
from workers.batch import Entry

MARK_TTL_S = 86_400
"""A mark outlives any wait for a reclaim (a parked stage's back-off included)."""

QUEUED = b"q"
"""The mark of an entry charged by an earlier crash, waiting to run alone."""


def marks(keys: Keys, entries: Sequence[Entry]) -> list[str]:
    """The on-model marks of ``entries`` (what their batch's publish deletes)."""
    return [keys.on_model(e.stream, e.id.decode()) for e in entries]


def mark(pipe: Any, keys: Keys, entries: Sequence[Entry], value: bytes | None = None) -> None:
    """Queue on ``pipe`` (a Redis pipeline) the marks of ``entries``: on the model in a
    batch of ``len(entries)``, or ``value``."""
    what = value if value is not None else str(len(entries)).encode()
    for key in marks(keys, entries):
        pipe.set(key, what, ex=MARK_TTL_S)


async def mark_now(client: aioredis.Redis, keys: Keys, entries: Sequence[Entry]) -> None:
    """Mark ``entries`` on the model in a round trip of its own (before a staged model's
    host phase, which runs before the batch's turn)."""
    pipe = client.pipeline(transaction=False)
    mark(pipe, keys, entries)
    await pipe.execute()


@dataclass
class Claimed:
    """Entries taken back from a worker that stopped reading, sorted by their marks."""

    charged: list[Entry] = field(default_factory=list)  # on the model at its crash
    queued: list[Entry] = field(default_factory=list)  # waiting to run alone
    waiting: list[Entry] = field(default_factory=list)  # not on the model

    def __iadd__(self, other: Claimed) -> Claimed:
        self.charged += other.charged
        self.queued += other.queued
        self.waiting += other.waiting
        return self

    @property
    def alone(self) -> list[Entry]:
        """What runs alone, one entry a batch: the charged and the queued."""
        return self.charged + self.queued

    def __bool__(self) -> bool:
        return bool(self.charged or self.queued or self.waiting)


async def claim_idle(
    client: aioredis.Redis,
    keys: Keys,
    stream: str,
    consumer: str,
    min_idle_ms: int,
    count: int,
) -> Claimed:
    """Take up to ``count`` entries of ``stream`` idle for ``min_idle_ms`` from any
    consumer, charging a delivery only to those its marks say were on the model.

    Entries deleted from the stream while pending are dropped from the group by the
    server (XAUTOCLAIM's third list); nothing is left to do for them.
    """
    ids = await client.xautoclaim(
        stream, GROUP, consumer, min_idle_ms, "0-0", count=count, justid=True
    )
    return await sort_out(client, keys, stream, consumer, [_raw(i) for i in ids])


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
    that was on the model (XCLAIM), fetch the others' fields without charging them, and
    mark those to run alone as queued: a crash while one of them runs is charged to it
    alone."""
    if not ids:
        return Claimed()
    found = await client.mget(marks(keys, [Entry(i, {}, stream) for i in ids]))
    on_model: list[Any] = [
        i for i, m in zip(ids, found, strict=True) if m is not None and m != QUEUED
    ]
    queued = {i for i, m in zip(ids, found, strict=True) if m == QUEUED}
    out = Claimed()
    if on_model:
        # Queued first: a worker dying between the two leaves them to run alone, never
        # charged twice for one crash.
        pipe = client.pipeline(transaction=False)
        mark(pipe, keys, [Entry(i, {}, stream) for i in on_model], QUEUED)
        await pipe.execute()
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
