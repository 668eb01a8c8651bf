"""Admission: refuse work a stage cannot take, before anything is enqueued.

Two tests, on a view of each stage refreshed at most every ``refresh_s``:

- the backlog bound: a stage holding ``max_backlog`` items (undelivered + in flight)
  takes no more;
- the deadline: from the backlog, the live workers and their learned batch cost
  (``a + b·n``, published by the workers), the time a new request would wait and run is
  predicted; one that would miss its deadline is refused now (503 + Retry-After) instead
  of timing out later (504). With no live worker or no learned cost yet, only the bound
  applies: the queue holds the work until workers come.

Between refreshes this process counts what it enqueued itself, so a burst cannot
overshoot by more than other gateways' share.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from pipelines.errors import Overloaded
from pipelines.keys import GROUP, Keys
from pipelines.redisio import text
from pipelines.stats import ALIVE_IDLE_MS, COST_A, COST_B, stage_backlog


@dataclass
class StageView:
    """What admission knows of a stage.

    Attributes:
        at: when it was measured (monotonic seconds).
        backlog: items undelivered or in flight.
        workers: consumers seen active recently.
        a: learned fixed seconds per batch (0 if unknown).
        b: learned seconds per item (0 if unknown).
    """

    at: float
    backlog: int
    workers: int
    a: float
    b: float

    def predicted_s(self, extra: int, max_batch: int) -> float | None:
        """Seconds until a new request, ``extra`` places behind the backlog, is done;
        None when it cannot be predicted."""
        if self.workers == 0 or self.a + self.b <= 0:
            return None
        per_batch = self.a + self.b * max_batch
        rate = self.workers * max_batch / per_batch  # items per second, full batches
        return (self.backlog + extra) / rate + self.a + self.b


class Admission:
    """Refuses what a stage cannot take (see module doc).

    Args:
        client: Redis client.
        keys: key names.
        refresh_s: how stale a stage's view may be.
        retry_after_s: the least Retry-After given with a refusal.
        headroom: admit only what is predicted to finish within this fraction of its
            deadline: the prediction is a mean, and batches' run times jitter.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        refresh_s: float,
        retry_after_s: int,
        headroom: float = 1.0,
    ) -> None:
        self.client = client
        self.headroom = headroom
        self.keys = keys
        self.refresh_s = refresh_s
        self.retry_after_s = retry_after_s
        self._views: dict[str, StageView] = {}
        self._since: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def view(self, stage: str) -> StageView:
        """The stage's view, refreshed when stale (one refresh at a time per stage).

        While one request refreshes it, the others decide on the stale view rather than
        queue behind the refresh: a refusal should cost no Redis round trip.
        """
        view = self._views.get(stage)
        lock = self._locks.setdefault(stage, asyncio.Lock())
        if view is not None and lock.locked():
            return view
        if view is None or time.monotonic() - view.at > self.refresh_s:
            async with lock:
                view = self._views.get(stage)
                if view is None or time.monotonic() - view.at > self.refresh_s:
                    view = await self._measure(stage)
                    self._views[stage] = view
                    self._since[stage] = 0
        return view

    async def _measure(self, stage: str) -> StageView:
        stream = self.keys.stage_stream(stage)
        backlog = await stage_backlog(self.client, self.keys, stage)
        workers = 0
        if backlog:
            try:
                consumers = await self.client.xinfo_consumers(stream, GROUP)
            except aioredis.ResponseError:  # no group yet: no worker ever came
                consumers = []
            workers = sum(1 for c in consumers if int(c["idle"]) < ALIVE_IDLE_MS)
        a, b = await self.client.hmget(self.keys.stage_stats(stage), [COST_A, COST_B])
        return StageView(
            time.monotonic(), backlog, workers,
            float(text(a)) if a else 0.0, float(text(b)) if b else 0.0,
        )  # fmt: skip

    async def admit(self, stage: str, bound: int, timeout_s: float, max_batch: int) -> None:
        """Count one request against ``stage``, or refuse it.

        Args:
            stage: the entry stage.
            bound: the stage's backlog bound.
            timeout_s: the request's time budget.
            max_batch: the stage's batch bound (for the throughput estimate).

        Raises:
            Overloaded: the backlog is at its bound, or the request would miss its
                deadline; ``retry_after`` says when the backlog should have drained.
        """
        view = await self.view(stage)
        extra = self._since.get(stage, 0)
        current = view.backlog + extra
        if current >= bound:
            raise Overloaded(
                f"stage {stage!r} is at capacity ({current} waiting, bound {bound}); "
                f"retry after {self.retry_after_s}s",
                retry_after=self.retry_after_s,
            )
        predicted = view.predicted_s(extra, max_batch)
        if predicted is not None and predicted > timeout_s * self.headroom:
            retry = max(self.retry_after_s, math.ceil(predicted - timeout_s))
            where = "past" if predicted > timeout_s else f"within {1 - self.headroom:.0%} of"
            raise Overloaded(
                f"stage {stage!r} would finish this request in about {predicted:.1f}s, "
                f"{where} its {timeout_s:g}s deadline; retry after {retry}s",
                retry_after=retry,
            )
        self._since[stage] = extra + 1
