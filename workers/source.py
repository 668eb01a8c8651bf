"""Where a worker's batches come from: a reclaimed suspect, alone, else the window's next
batch, cut by length where the stage is length-aware; and what a failed read does.

Before each read, :class:`~workers.recovery.Recovery` does its duties that are due: it
may hand over a reclaimed entry to run alone (a suspect) and entries it dead-lettered,
which are published here, before anything new is read. A read that fails waits Redis
out, or re-creates the stage's group if Redis lost it.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pipelines.keys import Keys
from runtime.redisio import REDIS_DOWN, Backoff, ensure_group, group_missing
from workers.batch import Entry
from workers.lanes import Lanes
from workers.lengths import Lengths
from workers.publish import Publisher
from workers.recovery import Recovery
from workers.window import Window

logger = logging.getLogger(__name__)


class Taken(NamedTuple):
    """What one read gave: batches to run back to back (none: nothing came), and whether
    the one batch is a suspect."""

    batches: list[list[Entry]]
    suspect: bool = False


class Source:
    """One worker's batches.

    Args:
        client: Redis client.
        keys: the namespace's keys, at the worker's partition.
        stage: the stage served.
        streams: its stream of each lane.
        window: closes batches.
        lanes: reads the lanes.
        recovery: the worker's recovery duties.
        lengths: cuts a window by length (None: item-count batching).
        publish: publishes what recovery ended.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        stage: str,
        streams: list[str],
        window: Window,
        lanes: Lanes,
        recovery: Recovery,
        lengths: Lengths | None,
        publish: Publisher,
    ) -> None:
        self.client, self.keys, self.stage, self.streams = client, keys, stage, streams
        self.window, self.lanes, self.recovery = window, lanes, recovery
        self.lengths, self.publish = lengths, publish
        self._backoff = Backoff()

    async def next(self, block_ms: int | None) -> Taken:
        """The next batches: a suspect alone, else what the window closed (nothing when
        nothing came within ``block_ms``, or the read failed and was waited out).

        Raises:
            ResponseError: Redis refused the read for another reason than a lost group.
        """
        try:
            taken = await self._take(block_ms)
        except (*REDIS_DOWN, ResponseError) as exc:
            await self._read_failed(exc)
            return Taken([])
        self._backoff.reset()
        return taken

    async def ensure_stream(self) -> None:
        """Create each lane's stream and group (idempotent) and register the stage."""
        for stream in self.streams:
            await ensure_group(self.client, stream)
        await self.client.sadd(self.keys.stages_set(), self.stage)

    async def _take(self, block_ms: int | None) -> Taken:
        due = await self.recovery.next()
        if due.settled is not None:  # dead letters: answered, acked, kept
            await self.publish(*due.settled)
            self.recovery.published(due.settled)
        if due.suspect is not None:
            return Taken([[due.suspect]], suspect=True)
        if due.waiting:  # taken back, not on the model when their worker died
            return self._cut(list(due.waiting))
        entries = await self.window.assemble(block_ms)
        if not entries:
            return Taken([])
        self.lanes.assembled()
        return self._cut(entries)

    def _cut(self, entries: list[Entry]) -> Taken:
        # A length-aware stage runs the window's entries as batches of similar length,
        # back to back (workers/lengths.py).
        return Taken([entries] if self.lengths is None else self.lengths.split(entries))

    async def _read_failed(self, exc: BaseException) -> None:
        """Wait out a failed read (Redis unreachable) or re-create a lost group."""
        if isinstance(exc, REDIS_DOWN) or not isinstance(exc, ResponseError):
            logger.warning(
                "stage %s: redis unreachable (%s); retry in %.1fs",
                self.stage,
                exc,
                self._backoff.next_s,
            )
            await self._backoff.wait()
            return
        if not group_missing(exc):
            raise exc
        # What the group held is gone with it; what comes next must not be.
        logger.warning("stage %s: %s; re-creating the stream's group", self.stage, exc)
        try:
            await self.ensure_stream()
        except REDIS_DOWN:  # gone again: the next read backs off
            await self._backoff.wait()
