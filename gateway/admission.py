"""Admission: refuse work a stage cannot take before anything is enqueued."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from pipelines.errors import Overloaded
from pipelines.keys import Keys
from pipelines.stats import stage_backlog


class Admission:
    """Bounds each stage's backlog, measured in Redis and refreshed at most every
    ``refresh_s``; between refreshes this process counts what it enqueued itself, so a
    burst cannot overshoot the bound by more than other gateways' share.

    Args:
        client: Redis client.
        keys: key names.
        refresh_s: how stale a measured backlog may be.
        retry_after_s: the Retry-After given with a refusal.
    """

    def __init__(
        self, client: aioredis.Redis, keys: Keys, refresh_s: float, retry_after_s: int
    ) -> None:
        self.client = client
        self.keys = keys
        self.refresh_s = refresh_s
        self.retry_after_s = retry_after_s
        self._measured: dict[str, tuple[float, int]] = {}
        self._since: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def backlog(self, stage: str) -> int:
        """The stage's backlog as last measured plus what this process added since."""
        at, value = self._measured.get(stage, (-1.0, 0))
        if time.monotonic() - at > self.refresh_s:
            lock = self._locks.setdefault(stage, asyncio.Lock())
            async with lock:  # one refresh at a time; the others reuse its answer
                at, value = self._measured.get(stage, (-1.0, 0))
                if time.monotonic() - at > self.refresh_s:
                    value = await stage_backlog(self.client, self.keys, stage)
                    self._measured[stage] = (time.monotonic(), value)
                    self._since[stage] = 0
        return value + self._since.get(stage, 0)

    async def admit(self, stage: str, bound: int) -> None:
        """Count one request against ``stage``'s bound.

        Raises:
            Overloaded: the stage already holds ``bound`` or more items.
        """
        current = await self.backlog(stage)
        if current >= bound:
            raise Overloaded(
                f"stage {stage!r} is at capacity ({current} waiting, bound {bound}); "
                f"retry after {self.retry_after_s}s",
                retry_after=self.retry_after_s,
            )
        self._since[stage] = self._since.get(stage, 0) + 1
