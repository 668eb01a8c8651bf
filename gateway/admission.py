"""Admission: refuse work a stage cannot take, before anything is enqueued.

Three tests, on a view of each stage refreshed at most every ``refresh_s``:

- parked: a stage whose workers ``conveyor up`` parked after a crash loop takes nothing
  until they start again (its :attr:`~runtime.status.StageStatus.parked`);

- the backlog bound: a stage holding ``max_backlog`` items (its
  :attr:`~runtime.status.StageStatus.backlog`: undelivered + in flight, both lanes)
  takes no more, in either lane;
- the deadline: from the backlog ahead of the request, the live workers and their learned
  batch cost (``a + b·n``, published by the workers), the time a new request would wait
  and run is predicted; one that would miss its deadline is refused now (503 +
  Retry-After) instead of timing out later (504). What is ahead depends on the lane:
  workers take interactive work first, so an interactive request waits behind the
  interactive backlog only, a bulk one behind both lanes'. With no live worker or no
  learned cost yet, only the bound applies: the queue holds the work until workers come.

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
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from pipelines.errors import Overloaded, PastDeadline
from pipelines.keys import DEFAULT_LANE, LANES, Keys, Lane
from runtime.redisio import REDIS_DOWN
from runtime.status import StageStatus, stage_status
from runtime.waiting import cancel_and_wait

logger = logging.getLogger(__name__)

Counts = dict[Lane, int]
"""Requests this process admitted to a stage, per lane."""

AHEAD: dict[Lane, tuple[Lane, ...]] = {"interactive": ("interactive",), "bulk": LANES}
"""The lanes whose backlog a new request of each lane waits behind."""


@dataclass
class Reading:
    """A stage's state as admission measured it, and when.

    Attributes:
        at: when it was measured (monotonic seconds).
        state: what was measured.
        counted: how many requests this process had admitted, per lane, when the
            measurement began; those admitted since are added to the state's backlog.
    """

    at: float
    state: StageStatus
    counted: Counts = field(default_factory=dict)
    backlogs: dict[Lane, int] = field(init=False)

    def __post_init__(self) -> None:
        # Read by every admitted request until the next measurement: taken apart once.
        self.backlogs = {lane: self.state.lane(lane).backlog for lane in LANES}

    def waiting(self, admitted: Counts, lanes: Iterable[Lane] = LANES) -> tuple[int, int]:
        """(measured, since) of ``lanes``: their backlog when measured, and what this
        process admitted to them since (``admitted``: its counts now)."""
        measured = since = 0
        for lane in lanes:
            measured += self.backlogs.get(lane, 0)
            since += admitted.get(lane, 0) - self.counted.get(lane, 0)
        return measured, since

    def predicted_s(self, ahead: tuple[int, int], max_batch: int) -> float | None:
        """Seconds until a new request is done behind ``ahead`` (:meth:`waiting` of the
        lanes it waits behind); None when it cannot be predicted: no live worker, no
        learned cost, or nothing ahead when measured (whatever its cost, the next request
        goes first)."""
        state = self.state
        measured, since = ahead
        if measured == 0 or state.workers == 0 or state.a + state.b <= 0:
            return None
        per_batch = state.a + state.b * max_batch
        rate = state.workers * max_batch / per_batch  # items per second, full batches
        return (measured + since) / rate + state.a + state.b


@dataclass(eq=False)  # one per process: compared by identity
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

    client: aioredis.Redis
    keys: Keys
    refresh_s: float
    retry_after_s: int
    headroom: float = 1.0
    _views: dict[str, Reading] = field(init=False, default_factory=dict)
    _admitted: dict[str, Counts] = field(init=False, default_factory=dict)
    _refreshing: dict[str, asyncio.Task[Reading]] = field(init=False, default_factory=dict)

    async def view(self, stage: str) -> Reading:
        """The stage's view; the first one is measured now, a stale one is re-measured in
        the background (one refresh at a time per stage) and returned meanwhile."""
        view = self._views.get(stage)
        if view is None:
            return await self.refresh(stage)
        if self._stale(view) and stage not in self._refreshing:
            self._refresh_behind(stage)
        return view

    def _refresh_behind(self, stage: str) -> None:
        """Re-measure ``stage`` in the background (the caller checked none is under way)."""
        task = asyncio.get_running_loop().create_task(self.refresh(stage, behind=True))
        self._refreshing[stage] = task
        task.add_done_callback(lambda t: self._refreshed(stage, t))

    async def refresh(self, stage: str, *, behind: bool = False) -> Reading:
        """Measure ``stage`` now (joining a refresh already under way) and keep the view;
        ``behind`` a call (in the background), once the loop has run what is ready: the
        call that found the view stale sends its write first (its round trip starts in
        the next iteration too), not after the status read's."""
        if behind:
            await asyncio.sleep(0)
        running = self._refreshing.get(stage)
        if running is not None and asyncio.current_task() is not running:
            return await asyncio.shield(running)
        count = dict(self._admitted.get(stage, {}))
        view = await self._measure(stage, count)
        latest = self._views.get(stage)
        if latest is None or sum(latest.counted.values()) <= sum(view.counted.values()):
            self._views[stage] = view
        return view

    async def close(self) -> None:
        """Stop the refreshes under way and wait for them: one left running past its
        gateway's close would open a connection on the closed client, never to be closed."""
        await cancel_and_wait(list(self._refreshing.values()))

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

    async def _measure(self, stage: str, counted: Counts) -> Reading:
        state = await stage_status(self.client, self.keys, stage, costs=True)
        return Reading(time.monotonic(), state, counted)

    async def admit(
        self, stage: str, bound: int, timeout_s: float, max_batch: int, lane: Lane = DEFAULT_LANE
    ) -> None:
        """Count one request against ``stage``, or refuse it.

        Args:
            stage: the entry stage.
            bound: the stage's backlog bound, for each lane: the request's lane's backlog
                is held to it.
            timeout_s: the request's time budget.
            max_batch: the stage's batch bound (for the throughput estimate).
            lane: the request's lane (what it waits behind: :data:`AHEAD`).

        Raises:
            Overloaded: the backlog is at its bound, or the request would miss its
                deadline; ``retry_after`` says when the backlog should have drained.
        """
        if self.admit_now(stage, bound, timeout_s, max_batch, lane):
            return
        view = await self.view(stage)
        refusal = self._refusal(view, stage, bound, timeout_s, max_batch, lane)
        if refusal is not None and self._stale(view):
            # Admitting on a stale view is cheap to get wrong, refusing is not: a refusal
            # is decided on a fresh one (a round trip, shared with any refresh under way).
            view = await self.refresh(stage)
            refusal = self._refusal(view, stage, bound, timeout_s, max_batch, lane)
        if refusal is not None:
            raise refusal
        self._count(stage, lane)

    def admit_now(
        self, stage: str, bound: int, timeout_s: float, max_batch: int, lane: Lane = DEFAULT_LANE
    ) -> bool:
        """:meth:`admit` where it needs no wait, the common case: True once the request
        is counted, False where :meth:`admit` must wait (no view of the stage yet, or a
        stale view that would refuse it). A stale view is re-measured in the background,
        as :meth:`view` does. Its arguments are :meth:`admit`'s.

        Raises:
            Overloaded: as :meth:`admit`, on a view that is not stale.
        """
        view = self._views.get(stage)
        if view is None:
            return False
        stale = self._stale(view)
        if stale and stage not in self._refreshing:
            self._refresh_behind(stage)
        refusal = self._refusal(view, stage, bound, timeout_s, max_batch, lane)
        if refusal is not None:
            if stale:
                return False
            raise refusal
        self._count(stage, lane)
        return True

    def _count(self, stage: str, lane: Lane) -> None:
        counts = self._admitted.setdefault(stage, {})
        counts[lane] = counts.get(lane, 0) + 1

    def _refusal(
        self, view: Reading, stage: str, bound: int, timeout_s: float, max_batch: int, lane: Lane
    ) -> Overloaded | None:
        parked = view.state.parked
        left_s = parked.left_s(time.time()) if parked is not None else 0.0
        if parked is not None and left_s > 0:
            # Its workers are stopped (conveyor up, after a crash loop): a request taken
            # now would only wait for them, most likely past its deadline.
            retry = max(self.retry_after_s, math.ceil(left_s))
            return Overloaded(
                f"stage {stage!r} is parked: {parked.reason}; its workers start again in "
                f"{math.ceil(left_s)}s; retry after {retry}s",
                retry_after=retry,
            )
        admitted = self._admitted.get(stage, {})
        # Each lane has its own bound: a deep bulk backlog never refuses interactive calls.
        current = sum(view.waiting(admitted, (lane,)))
        if current >= bound:
            return Overloaded(
                # The bound's names, so that a caller finds the setting (docs/client.md).
                f"stage {stage!r} is at capacity ({current} waiting in its {lane} lane, bound "
                f"{bound}: the stage's max_backlog, or CONVEYOR_MAX_BACKLOG); "
                f"retry after {self.retry_after_s}s",
                retry_after=self.retry_after_s,
            )
        predicted = view.predicted_s(view.waiting(admitted, AHEAD[lane]), max_batch)
        if predicted is not None and predicted > timeout_s * self.headroom:
            retry = max(self.retry_after_s, math.ceil(predicted - timeout_s))
            where = "past" if predicted > timeout_s else f"within {1 - self.headroom:.0%} of"
            return PastDeadline(
                f"stage {stage!r} would finish this request in about {predicted:.1f}s, "
                f"{where} its {timeout_s:g}s deadline; retry after {retry}s",
                retry_after=retry,
            )
        return None
