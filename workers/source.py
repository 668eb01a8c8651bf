"""Where a worker's batches come from: reclaimed suspects, as one batch, else the window's next
batch, cut by length where the stage is length-aware; and what a failed read does.

Before each read, :class:`~workers.recovery.Recovery` does its duties that are due: it
may hand over reclaimed entries to run again as one batch (suspects) and entries it dead-lettered,
which go to the loop to publish (:attr:`Taken.settled`) before anything new is read: the
read is the next call's. A read that fails (or a publish of dead letters, :meth:`Source.failed`)
waits Redis out, or re-creates the stage's group if Redis lost it.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pipelines.keys import Keys
from runtime.redisio import REDIS_DOWN, ensure_group, group_missing
from runtime.waiting import Backoff
from workers.lanes import Lanes
from workers.lengths import Lengths
from workers.recovery import Recovery
from workers.values import Entry, Settled
from workers.window import Window

logger = logging.getLogger(__name__)


class Taken(NamedTuple):
    """What one read gave: batches to run back to back (none: nothing came), whether the
    one batch is a suspect, and dead letters recovery ended, to publish before the batches
    (None: none)."""

    batches: list[list[Entry]]
    suspect: bool = False
    settled: Settled | None = None


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
    ) -> None:
        self.client, self.keys, self.stage, self.streams = client, keys, stage, streams
        self.window, self.lanes, self.recovery = window, lanes, recovery
        self.lengths = lengths
        self._backoff = Backoff()
        self._settling = False  # dead letters handed out: the next call reads

    async def next(self, block_ms: int | None) -> Taken:
        """The next batches: suspects as one batch, else what the window closed (nothing when
        nothing came within ``block_ms``, or the read failed and was waited out); or dead
        letters to publish first (then the window is read at the next call).

        Raises:
            ResponseError: Redis refused the read for another reason than a lost group.
        """
        try:
            taken = await self._take(block_ms)
        except (*REDIS_DOWN, ResponseError) as exc:
            await self.failed(exc)
            return Taken([])
        if taken.settled is None:  # reset once its dead letters are out, too
            self._backoff.reset()
        return taken

    async def ensure_stream(self) -> None:
        """Create each lane's stream and group (idempotent) and register the stage."""
        for stream in self.streams:
            await ensure_group(self.client, stream)
        await self.client.sadd(self.keys.stages_set(), self.stage)

    async def _take(self, block_ms: int | None) -> Taken:
        if self._settling:  # recovery's duties were done: its dead letters are out
            self._settling = False
            return await self._read(block_ms)
        due = await self.recovery.next()
        if due.settled is not None:  # dead letters: answered, acked, kept (by the loop)
            self._settling = not due.waiting
            return Taken(self._cut(list(due.waiting)) if due.waiting else [], settled=due.settled)
        if due.suspects:
            return Taken([list(due.suspects)], suspect=True)
        if due.waiting:  # taken back, not on the model when their worker died
            return Taken(self._cut(list(due.waiting)))
        return await self._read(block_ms)

    async def _read(self, block_ms: int | None) -> Taken:
        entries = await self.window.assemble(block_ms)
        if not entries:
            return Taken([])
        self.lanes.assembled()
        return Taken(self._cut(entries))

    def _cut(self, entries: list[Entry]) -> list[list[Entry]]:
        # A length-aware stage runs the window's entries as batches of similar length,
        # back to back (workers/lengths.py).
        return [entries] if self.lengths is None else self.lengths.split(entries)

    async def failed(self, exc: BaseException) -> None:
        """Wait out a failed read, or a failed publish of the dead letters it handed out
        (Redis unreachable: the next call goes to recovery again), or re-create a lost
        group.

        Raises:
            ResponseError: ``exc``, when Redis refused for another reason than a lost group.
        """
        self._settling = False
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
