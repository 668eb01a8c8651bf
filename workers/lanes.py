"""Priority lanes: how a batch shares its slots between a stage's two streams.

Each stage has one stream per lane (``Keys.stage_stream(stage, lane)``), each read in the
one consumer group. A batch takes interactive entries first and fills what is left of it
with bulk ones. So that bulk is never starved, interactive entries take at most
``max_batch - reserve`` slots of a batch while bulk has work, ``reserve`` being
``ceil(max_batch / bulk_every)``: bulk's guaranteed share of every batch. Interactive work
never waits behind a whole batch of bulk, and takes the reserve too when bulk has none.
While interactive work is active (read within :data:`ACTIVE_S`), bulk takes only its
reserve, so batches stay short for the interactive requests still coming; once interactive
is quiet, bulk fills whole batches.

Bulk waits for the model beyond its reserve: while an earlier batch holds it, a batch
being assembled takes bulk entries only up to the reserve, so it cannot fill up with bulk
and hold a later interactive arrival back by a whole batch; the window tops it up when the
model frees (:class:`workers.window.Window`). Interactive takes the reserve too when bulk
has none, so under interactive load the next batch of a model that runs long enough to be
looked at meanwhile (:meth:`workers.window.Window.look_pace_s`) is whole before the model
frees and nothing is read between two batches.

A read looks at both lanes without waiting, in one round trip (two XREADGROUPs in a
pipeline); only when every lane gave nothing and the window wants to wait does one
blocking XREADGROUP cover the lanes, so an idle worker still waits in Redis. That one read
may return up to ``count`` from each stream at once: what exceeds the batch's bound is
already delivered to this consumer, so it is kept and handed out first by the next read
(never dropped, never making a batch larger than its bound; a worker that stops runs it as
a last batch).

Redis ends a blocked read that timed out only at its next timer tick (``1000 / hz`` ms:
100 ms at the default ``hz 10``), so a short BLOCK overshoots by up to
:data:`SERVER_TICK_MS`: a 4 ms wait for a window's last arrivals took 85-100 ms. A wait
shorter than that is timed here instead: with the model busy, until it frees (what comes
meanwhile could not run before); with it idle, by looking again a few times until the wait
is over.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from pipelines.keys import GROUP
from runtime.redisio import text
from workers.load import Load
from workers.values import Entry

BUSY_BLOCK_MS = 20
"""The longest a read waits for a busy model to free before it returns (empty)."""
SERVER_TICK_MS = 100
"""Redis's timer tick at its default ``hz`` (10): a BLOCK shorter than this is not kept to."""
POLLS = 4
"""A short wait with the model idle looks for new entries this many times, the last at its
end."""
ACTIVE_S = 1.0
"""Interactive work read within this long makes the lane active: bulk then takes only its
reserve of a batch, so batches stay short for the interactive requests still coming."""


class Lanes:
    """Reads one worker's entries across its stage's lane streams.

    Args:
        client: Redis client.
        streams: the stage's stream of each lane, interactive first.
        consumer: this worker's consumer name.
        max_batch: the stage's batch bound.
        bulk_every: bulk's reserve is one slot in this many of each batch.
        load: the model's load (while it is busy, bulk waits).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        streams: Sequence[str],
        consumer: str,
        max_batch: int,
        bulk_every: int,
        load: Load,
    ) -> None:
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.load = load
        self.interactive, self.bulk = streams
        self.streams = tuple(streams)
        self.consumer = consumer
        self.reserve = math.ceil(max_batch / bulk_every)  # bulk's share of a batch
        self.room = max_batch - self.reserve  # interactive's, while bulk waits
        self._interactive_taken = 0  # in the batch being assembled
        self._bulk_taken = 0
        self._interactive_at = -math.inf  # when interactive work was last read
        self._empty = False  # every lane had nothing at the last look (or was drained)
        self._drained = False  # the last reads took all that every lane had
        self._carry: list[Entry] = []  # delivered by a blocking read past its bound
        # Items run apart (a function step): the most bulk entries running at once, so
        # slow jobs never hold every slot and interactive work is still read (None: no
        # cap); the loop keeps :attr:`bulk_held`, those running now.
        self.bulk_cap: int | None = None
        self.bulk_held = 0

    def assembled(self) -> None:
        """A batch has been assembled: the next one starts with its slots free."""
        self._interactive_taken = self._bulk_taken = 0

    def seated(self, interactive: int, bulk: int) -> None:
        """The slots each lane holds now, where the batch is not assembled but running
        (continuous decoding: :mod:`workers.decoding`): the next read takes each lane's
        share of what is left, so bulk holds no more than its reserve while interactive
        work comes."""
        self._interactive_taken, self._bulk_taken = interactive, bulk

    def release(self) -> list[Entry]:
        """The entries delivered here but not handed out yet (a drain runs them)."""
        held, self._carry = self._carry, []
        return held

    async def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to ``count`` new entries, interactive first within its room, blocking up to
        ``block_ms`` (None: not at all) only when no lane has any."""
        taken, self._carry = self._carry[:count], self._carry[count:]
        self._drained = False
        # Bulk waits for a busy model beyond its reserve, but not in a read that may not
        # wait (burst mode's, where an empty answer means "nothing left").
        busy = bool(self.load.busy) and block_ms is not None
        if self._empty and not busy and not taken and block_ms is not None:
            # Every lane was empty at the last look: one blocking read over them all (it
            # answers at once if something came meanwhile) instead of a look at each first.
            return self._count(await self._wait(count, block_ms))
        try:
            taken += await self._look(count - len(taken), busy)
        except BaseException:
            self._carry[:0] = taken  # taken from the carry: still the next read's, first
            raise
        if not taken and block_ms is not None:
            self._empty = not busy  # every lane was looked at, and had nothing
            if busy:
                # Nothing read now could run before the model frees: wait for that (an
                # event, not a BLOCK that could outlast it), then look once more.
                await self.load.freed(min(block_ms, BUSY_BLOCK_MS) / 1000)
                if not self.load.busy:
                    taken = await self._look(count, False)
                    self._empty = not taken
            else:
                taken = await self._wait(count, block_ms)
        return self._count(taken)

    async def _look(self, count: int, busy: bool) -> list[Entry]:
        """Up to ``count`` new entries, without waiting, each lane within its share: both
        lanes in one round trip (bulk asked for its part of a batch whose interactive
        room is full), a second only where interactive left bulk more room than that and
        bulk may have it."""
        room = max(0, min(count, self.room - self._interactive_taken))
        limit = count  # what bulk may take of this read
        if busy or time.monotonic() - self._interactive_at < ACTIVE_S:
            limit = min(limit, self.reserve - self._bulk_taken)
        limit = max(0, min(limit, self._bulk_free()))
        bulk_room = min(limit, count - room)
        first, bulk = await self._both(room, bulk_room)
        taken = first + bulk
        if len(first) < room and len(bulk) == bulk_room:
            # Interactive left more of the batch: bulk takes it, within its limit.
            more_room = min(limit, count - len(first)) - bulk_room
            more = await self._take(self.bulk, more_room)
            bulk_room += more_room
            bulk += more
            taken += more
        interactive_drained = len(first) < room
        if len(first) == room and len(taken) < count:
            # Interactive filled its room and bulk has no more: it takes the reserve.
            more = await self._take(self.interactive, count - len(taken))
            interactive_drained = len(more) < count - len(taken)
            taken += more
        # Both lanes gave less than asked: nothing is left in either, so the next read
        # waits over both at once (answered at once if anything came meanwhile) instead
        # of looking at each again: at low load, one read a batch, not three.
        self._drained = interactive_drained and len(bulk) < bulk_room
        return taken

    async def _both(self, room: int, bulk_room: int) -> tuple[list[Entry], list[Entry]]:
        """Up to ``room`` new interactive and ``bulk_room`` new bulk entries, without
        waiting: one round trip (a cluster client's pipeline is not used: each read
        goes alone)."""
        if room <= 0 or bulk_room <= 0 or self.cluster:
            first = await self._take(self.interactive, room)
            try:
                return first, await self._take(self.bulk, bulk_room)
            except BaseException:
                self._carry += first  # delivered here: handed out by the next read
                raise
        pipe = self.client.pipeline(transaction=False)
        for stream, n in ((self.interactive, room), (self.bulk, bulk_room)):
            pipe.xreadgroup(GROUP, self.consumer, {stream: ">"}, count=n)
        replies = await pipe.execute(raise_on_error=False)
        for reply in replies:  # as a read alone would raise it (NOGROUP unprefixed)
            if isinstance(reply, Exception):
                # What the other lane's read delivered to this consumer is handed out by
                # the next read, not left pending here until a reclaim.
                for other in replies:
                    if not isinstance(other, Exception):
                        self._carry += self._entries(other)
                raise reply
        first, bulk = (self._entries(reply) for reply in replies)
        return first, bulk

    def _bulk_free(self) -> int:
        """How many more bulk entries may be read now (under :attr:`bulk_cap`)."""
        if self.bulk_cap is None:
            return 1 << 30
        return max(0, self.bulk_cap - self.bulk_held - self._bulk_taken)

    def _count(self, taken: list[Entry]) -> list[Entry]:
        """Note what ``taken`` uses of the batch's slots (and whether anything came)."""
        interactive = sum(1 for e in taken if e.stream == self.interactive)
        self._interactive_taken += interactive
        self._bulk_taken += len(taken) - interactive
        if interactive:
            self._interactive_at = time.monotonic()
        if taken:
            self._empty = self._drained
        return taken

    async def _wait(self, count: int, block_ms: int) -> list[Entry]:
        """Every lane is empty: wait up to ``block_ms`` for new entries, in Redis unless
        the wait is too short for Redis to keep (see above)."""
        streams = dict.fromkeys(self.streams, ">")
        free = self._bulk_free()
        if free <= 0:  # bulk is full: looked at again soon, as its calls end
            del streams[self.bulk]
            block_ms = min(block_ms, BUSY_BLOCK_MS)
        count = min(count, max(free, 1))  # one read may give count of each stream
        if block_ms >= SERVER_TICK_MS:
            got = await self._xread(streams, count, block_ms)
        else:
            got = await self._poll(streams, count, block_ms)
        self._carry += got[count:]
        self._drained = len(got) < count  # each stream gave less than asked
        return got[:count]

    async def _poll(self, streams: dict[str, str], count: int, block_ms: int) -> list[Entry]:
        """Look for new entries :data:`POLLS` times over ``block_ms``, until some come."""
        step_s = block_ms / 1000 / POLLS
        for _ in range(POLLS):
            await asyncio.sleep(step_s)  # a timer: the wait itself, precise to ~1 ms
            got = await self._xread(streams, count, None)
            if got:
                return got
        return []

    async def _take(self, stream: str, count: int) -> list[Entry]:
        """Up to ``count`` new entries of ``stream``, without waiting (none asked: none
        read: COUNT 0 would mean all)."""
        if count <= 0:
            return []
        return await self._xread({stream: ">"}, count, None)

    async def _xread(
        self, streams: dict[str, str], count: int, block_ms: int | None
    ) -> list[Entry]:
        reply = await self.client.xreadgroup(
            GROUP, self.consumer, cast(Any, streams), count=count, block=block_ms
        )
        return self._entries(reply)

    @staticmethod
    def _entries(reply: Any) -> list[Entry]:
        return [
            Entry(eid, fields, text(name))
            for name, entries in cast(list[Any], reply or [])
            for eid, fields in entries
        ]
