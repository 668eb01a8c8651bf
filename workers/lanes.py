"""Priority lanes: which of a stage's streams a batch reads first.

Each stage has one stream per lane (``Keys.stage_stream(stage, lane)``), each read in the
one consumer group. A batch takes interactive entries first and fills what is left of it
with bulk ones. So that bulk is never starved, every ``bulk_every``-th batch this worker
assembles takes bulk first and fills up with interactive: the rule counts every batch
(not only those that found both lanes waiting), which guarantees bulk at least one batch
in ``bulk_every`` whenever it has work, and costs nothing when it has none (a bulk-first
read of an empty bulk stream simply goes on to interactive).

Bulk waits for the model: while an earlier batch holds it, a batch being assembled takes
interactive entries only (but on its bulk-first turn), so it cannot fill up with bulk and
hold a later interactive arrival back by a whole batch; the window tops it up with bulk
when the model frees (:class:`workers.window.Window`). A read that leaves bulk out waits
at most :data:`BUSY_BLOCK_MS`, so the model is never left idle while bulk waits.

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
from workers.batch import Entry, Runner

BUSY_BLOCK_MS = 20
"""The longest a read waits on the interactive lane alone (the model busy, bulk held back)."""


class Lanes:
    """Reads one worker's entries across its stage's lane streams.

    Args:
        client: Redis client.
        streams: the stage's stream of each lane, interactive first.
        consumer: this worker's consumer name.
        bulk_every: every this-many-th batch reads the last lane (bulk) first.
        runner: the model thread (while it is busy, bulk waits but on its turn).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        streams: Sequence[str],
        consumer: str,
        bulk_every: int,
        runner: Runner,
    ) -> None:
        self.client = client
        self.runner = runner
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
        if self.runner.busy and order[0] == self.streams[0]:
            order = order[:1]  # bulk waits for the model (see above)
            block_ms = None if block_ms is None else min(block_ms, BUSY_BLOCK_MS)
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
