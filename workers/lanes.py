"""Priority lanes: which of a stage's streams a batch reads first.

Each stage has one stream per lane (``Keys.stage_stream(stage, lane)``), each read in the
one consumer group. A batch takes interactive entries first and fills what is left of it
with bulk ones. So that bulk is never starved, every ``bulk_every``-th batch this worker
assembles takes bulk first and fills up with interactive: the rule counts every batch
(not only those that found both lanes waiting), which guarantees bulk at least one batch
in ``bulk_every`` whenever it has work, and costs nothing when it has none (a bulk-first
read of an empty bulk stream simply goes on to interactive).

A read is non-blocking on the first lane, then on the second for what is left; only when
both gave nothing and the window wants to wait does one blocking XREADGROUP cover every
lane, so an idle worker still waits in Redis. That one read may return up to ``count``
from each stream at once: what exceeds the batch's bound is already delivered to this
consumer, so it is kept and handed out first by the next read (never dropped, never
making a batch larger than its bound; a worker that stops runs it as a last batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import redis.asyncio as aioredis

from pipelines.keys import GROUP
from pipelines.redisio import text
from workers.batch import Entry


class Lanes:
    """Reads one worker's entries across its stage's lane streams.

    Args:
        client: Redis client.
        streams: the stage's stream of each lane, interactive first.
        consumer: this worker's consumer name.
        bulk_every: every this-many-th batch reads the last lane (bulk) first.
    """

    def __init__(
        self, client: aioredis.Redis, streams: Sequence[str], consumer: str, bulk_every: int
    ) -> None:
        self.client = client
        self.streams = tuple(streams)
        self.consumer = consumer
        self.bulk_every = bulk_every
        self.batches = 0  # batches assembled so far
        self._carry: list[Entry] = []  # delivered by a blocking read past its bound

    @property
    def order(self) -> tuple[str, ...]:
        """The streams in the order the batch being assembled reads them."""
        if (self.batches + 1) % self.bulk_every == 0:
            return self.streams[::-1]
        return self.streams

    def assembled(self) -> None:
        """A batch has been assembled: the next one picks its order afresh."""
        self.batches += 1

    def release(self) -> list[Entry]:
        """The entries delivered here but not handed out yet (a drain runs them)."""
        held, self._carry = self._carry, []
        return held

    async def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to ``count`` new entries, in lane order, blocking up to ``block_ms`` (None:
        not at all) only when no lane has any."""
        taken, self._carry = self._carry[:count], self._carry[count:]
        order = self.order
        for stream in order:
            if len(taken) >= count:
                return taken
            taken += await self._xread({stream: ">"}, count - len(taken), None)
        if taken or block_ms is None:
            return taken
        got = await self._xread(dict.fromkeys(order, ">"), count, block_ms)
        self._carry += got[count:]
        return got[:count]

    async def _xread(
        self, streams: dict[str, str], count: int, block_ms: int | None
    ) -> list[Entry]:
        reply = await self.client.xreadgroup(
            GROUP, self.consumer, cast(Any, streams), count=count, block=block_ms
        )
        return [
            Entry(eid, fields, text(name))
            for name, entries in cast(list[Any], reply or [])
            for eid, fields in entries
        ]
