"""The crash-loop parks of ``conveyor up``: which worker groups (and gateways) are parked,
until when and why, said on ``up``'s output and recorded in Redis for their stages
(:class:`~pipelines.records.Parked`), which the gateways then refuse with 503 +
Retry-After. When a group is parked and for how long is :mod:`conveyor.restarts`'; its
processes are stopped and started again by :class:`~conveyor.supervisor.Supervisor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from redis.exceptions import RedisError

from conveyor.children import say
from conveyor.restarts import CrashLoop
from pipelines.records import Parked
from pipelines.settings import CommonSettings
from runtime.redisio import REDIS_DOWN, connect


class Park(NamedTuple):
    """One parked group.

    Attributes:
        until: when it is started again (monotonic seconds).
        stages: its stages (none for a gateway).
        why: why it is parked.
        for_s: how long.
    """

    until: float
    stages: list[str]
    why: str
    for_s: float


@dataclass
class Parks:
    """The groups parked now, by name (a worker group's, or a gateway's).

    Args:
        crashes: the crash counts, which say how long each park lasts.
    """

    crashes: CrashLoop
    parked: dict[str, Park] = field(default_factory=dict)

    def __contains__(self, group: str) -> bool:
        return group in self.parked

    def park(self, group: str, stages: list[str], why: str) -> None:
        """Park ``group`` (serving ``stages``) because ``why``, for as long as its crash
        count says, and say so."""
        for_s = self.crashes.park(group)
        self.parked[group] = Park(time.monotonic() + for_s, stages, why, for_s)
        say(
            f"{why}; parking {group} for {for_s:g}s (its requests get 503 + Retry-After; "
            "everything else goes on serving)"
        )

    def due(self, now: float) -> list[str]:
        """The groups whose park is over at ``now`` (monotonic seconds)."""
        return [g for g, park in self.parked.items() if now >= park.until]

    def end(self, group: str) -> list[str]:
        """``group``'s park is over (said: it is started again); its stages."""
        park = self.parked.pop(group)
        say(f"{group}: its park is over; starting it again")
        return park.stages

    async def record(self, settings: CommonSettings, group: str) -> None:
        """Record in Redis that ``group``'s stages are parked, and why."""
        park = self.parked[group]
        await self._mark(settings, park.stages, park.why, park.for_s)

    async def back(self, settings: CommonSettings, stages: list[str]) -> None:
        """Record in Redis that ``stages`` (of a group whose park is over) are back."""
        await self._mark(settings, stages, "", None)

    async def remind(self, settings: CommonSettings, now: float) -> None:
        """Record every park again, for the time each has left: the Redis that held them
        was started again, and knows nothing of them."""
        for park in self.parked.values():
            await self._mark(settings, park.stages, "parked", park.until - now)

    def release(self, settings: CommonSettings) -> None:
        """Record every parked stage back (``up`` stops; its Redis goes on without it)."""
        stages = [s for park in self.parked.values() for s in park.stages]
        if stages:
            with contextlib.suppress(*REDIS_DOWN):
                asyncio.run(mark_parked(settings, stages, "", None))

    async def _mark(
        self, settings: CommonSettings, stages: list[str], why: str, for_s: float | None
    ) -> None:
        if not stages:  # a gateway's park: nothing to refuse
            return
        try:
            await mark_parked(settings, stages, why, for_s)
        except RedisError as exc:  # unreachable, or a key of ours forged to another type
            say(f"could not record in redis that {','.join(stages)} is parked: {exc}")


async def mark_parked(
    settings: CommonSettings, stages: Iterable[str], why: str, for_s: float | None
) -> None:
    """Say in Redis that ``stages`` are parked for ``for_s`` seconds because ``why``
    (:class:`~pipelines.records.Parked`), or (``for_s`` None) that they are back.

    Raises:
        RedisError, OSError: Redis could not be reached (the caller says so and goes on).
    """
    client = connect(settings)
    key = settings.keys.parked()
    try:
        for stage in stages:
            if for_s is None:
                await client.hdel(key, stage)
            else:
                await client.hset(key, stage, Parked(why, time.time() + for_s).encode())
    finally:
        await client.aclose()
