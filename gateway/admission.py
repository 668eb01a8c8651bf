"""Admission: refuse work a stage cannot take, before anything is enqueued.

Two tests, on a view of each stage refreshed at most every ``refresh_s``:

- the backlog bound: a stage holding ``max_backlog`` items (its
  :attr:`~pipelines.stats.StageStatus.backlog`: undelivered + in flight) takes no more;
- the deadline: from the backlog, the live workers and their learned batch cost
  (``a + b·n``, published by the workers), the time a new request would wait and run is
  predicted; one that would miss its deadline is refused now (503 + Retry-After) instead
  of timing out later (504). With no live worker or no learned cost yet, only the bound
  applies: the queue holds the work until workers come.

Between refreshes this process counts what it admitted itself, so a burst cannot
overshoot by more than other gateways' share. A stale view is re-measured in the
background while requests go on deciding on it, so no admitted request waits for the
measurement; a request the stale view would refuse waits for the fresh one, so nothing
is refused on old news.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from pipelines.errors import Overloaded
from pipelines.keys import Keys
from pipelines.redisio import REDIS_DOWN
from pipelines.stats import StageStatus, stage_status

logger = logging.getLogger(__name__)


@dataclass
class Reading:
    """A stage's state as admission measured it, and when.

    Attributes:
        at: when it was measured (monotonic seconds).
        state: what was measured.
        counted: how many requests this process had admitted when the measurement
            began; those admitted since are added to the state's backlog.
    """

    at: float
    state: StageStatus
    counted: int = 0

    def predicted_s(self, extra: int, max_batch: int) -> float | None:
        """Seconds until a new request, ``extra`` places behind the backlog, is done;
        None when it cannot be predicted: no live worker, no learned cost, or an empty
        stage (whatever its cost, the next request goes first)."""
        state = self.state
        if state.backlog == 0 or state.workers == 0 or state.a + state.b <= 0:
            return None
        per_batch = state.a + state.b * max_batch
        rate = state.workers * max_batch / per_batch  # items per second, full batches
        return (state.backlog + extra) / rate + state.a + state.b


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
        self._views: dict[str, Reading] = {}
        self._admitted: dict[str, int] = {}
        self._refreshing: dict[str, asyncio.Task[Reading]] = {}

    async def view(self, stage: str) -> Reading:
        """The stage's view; the first one is measured now, a stale one is re-measured in
        the background (one refresh at a time per stage) and returned meanwhile."""
        view = self._views.get(stage)
        if view is None:
            return await self.refresh(stage)
        if self._stale(view) and stage not in self._refreshing:
            task = asyncio.get_running_loop().create_task(self.refresh(stage))
            self._refreshing[stage] = task
            task.add_done_callback(lambda t: self._refreshed(stage, t))
        return view

    async def refresh(self, stage: str) -> Reading:
        """Measure ``stage`` now (joining a refresh already under way) and keep the view."""
        running = self._refreshing.get(stage)
        if running is not None and asyncio.current_task() is not running:
            return await asyncio.shield(running)
        count = self._admitted.get(stage, 0)
        view = await self._measure(stage, count)
        latest = self._views.get(stage)
        if latest is None or latest.counted <= view.counted:
            self._views[stage] = view
        return view

    def _stale(self, view: Reading) -> bool:
        return time.monotonic() - view.at > self.refresh_s

    def _refreshed(self, stage: str, task: asyncio.Task[Reading]) -> None:
        self._refreshing.pop(stage, None)
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, REDIS_DOWN):
            # The enqueue that follows says so (503); the next request tries again.
            logger.debug("stage %s: admission could not refresh: %s", stage, exc)
        elif exc is not None:
            logger.warning("stage %s: admission could not refresh", stage, exc_info=exc)

    async def _measure(self, stage: str, counted: int) -> Reading:
        state = await stage_status(self.client, self.keys, stage, costs=True)
        return Reading(time.monotonic(), state, counted)

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
        refusal = self._refusal(view, stage, bound, timeout_s, max_batch)
        if refusal is not None and self._stale(view):
            # Admitting on a stale view is cheap to get wrong, refusing is not: a refusal
            # is decided on a fresh one (a round trip, shared with any refresh under way).
            view = await self.refresh(stage)
            refusal = self._refusal(view, stage, bound, timeout_s, max_batch)
        if refusal is not None:
            raise refusal
        self._admitted[stage] = self._admitted.get(stage, 0) + 1

    def _refusal(
        self, view: Reading, stage: str, bound: int, timeout_s: float, max_batch: int
    ) -> Overloaded | None:
        extra = self._admitted.get(stage, 0) - view.counted
        current = view.state.backlog + extra
        if current >= bound:
            return Overloaded(
                f"stage {stage!r} is at capacity ({current} waiting, bound {bound}); "
                f"retry after {self.retry_after_s}s",
                retry_after=self.retry_after_s,
            )
        predicted = view.predicted_s(extra, max_batch)
        if predicted is not None and predicted > timeout_s * self.headroom:
            retry = max(self.retry_after_s, math.ceil(predicted - timeout_s))
            where = "past" if predicted > timeout_s else f"within {1 - self.headroom:.0%} of"
            return Overloaded(
                f"stage {stage!r} would finish this request in about {predicted:.1f}s, "
                f"{where} its {timeout_s:g}s deadline; retry after {retry}s",
                retry_after=retry,
            )
        return None
