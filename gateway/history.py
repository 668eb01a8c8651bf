"""The recent past of every stage, for the status page: throughput and latency percentiles.

The stage counters in Redis (:mod:`runtime.stats`) are cumulative; a rate or a recent
percentile needs two readings some time apart. The gateway takes one every
:data:`SAMPLE_S` and keeps :data:`KEEP_S` of them, so the page shows the last minutes as
soon as it opens instead of only what happens while it is open. Each gateway keeps its
own (they read the same counters, so they agree); one started a moment ago has only that
moment.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple, TypedDict

import redis.asyncio as aioredis

from pipelines.keys import Keys
from pipelines.outcomes import Outcome
from runtime.metrics import BUCKETS, le_label
from runtime.redisio import REDIS_DOWN, RedisClock
from runtime.stats import read_all_stats
from runtime.waiting import cancel_and_wait

logger = logging.getLogger(__name__)

SAMPLE_S = 2.0
"""Seconds between two readings of the counters."""
KEEP_S = 180.0
"""How far back the history goes (the status page's chart is three minutes wide)."""
LATENCY_S = 60.0
"""The percentiles cover the batches of about this long before now."""


class Percentiles(TypedDict):
    """p50 and p99 in seconds; None where no batch ran in the interval."""

    p50: float | None
    p99: float | None


class Latency(TypedDict):
    """A stage's recent queue wait (per item) and model time (per batch)."""

    queue_wait: Percentiles
    run: Percentiles


class Rates(TypedDict):
    """Items done per second in each interval between readings: ``times[i]`` is the end
    of interval ``i`` (server clock, seconds); ``stages[stage][i]`` its rate."""

    times: list[float]
    stages: dict[str, list[float]]


class Sample(NamedTuple):
    """One reading: when (server clock), and each stage's counters."""

    time: float
    stats: dict[str, dict[str, float]]


def quantile(bounds: Sequence[float], counts: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile of a histogram (``counts`` per bucket, not cumulative, the last
    past the last bound), interpolated linearly within its bucket as Prometheus's
    ``histogram_quantile`` does; the last finite bound when it falls past it; None for no
    observations."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen, lower = q * total, 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=False):
        if count and seen + count >= rank:
            return lower + (bound - lower) * (rank - seen) / count
        seen += count
        lower = bound
    return bounds[-1]


def _done(stats: dict[str, float]) -> float:
    return sum(stats.get(outcome.stats_field, 0.0) for outcome in Outcome)


def _buckets(stats: dict[str, float], name: str) -> list[float]:
    bounds = (*BUCKETS[name], float("inf"))
    return [stats.get(f"h:{name}:{le_label(b)}", 0.0) for b in bounds]


class History:
    """Readings of the stage counters, taken in the background.

    Args:
        client: Redis client.
        keys: key names.
        stages: the stages read.
        clock: the Redis clock (times are on it, as ``/status.json``'s ``time``).
    """

    def __init__(
        self, client: aioredis.Redis, keys: Keys, stages: Iterable[str], clock: RedisClock
    ) -> None:
        self.client, self.keys, self.stages, self.clock = client, keys, list(stages), clock
        self.samples: deque[Sample] = deque(maxlen=int(KEEP_S / SAMPLE_S) + 1)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start taking readings."""
        self._task = asyncio.create_task(self._run(), name="status-history")

    async def stop(self) -> None:
        """Stop taking readings."""
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def sample(self) -> None:
        """Take one reading (one round trip for every stage and partition)."""
        stats = await read_all_stats(self.client, self.keys, self.stages)
        self.samples.append(Sample(self.clock.now(), stats))

    async def _run(self) -> None:
        while True:
            try:
                await self.sample()
            except REDIS_DOWN as exc:  # the page says so; the history just has a gap
                logger.debug("status history: no reading: %s", exc)
            await asyncio.sleep(SAMPLE_S)

    def rates(self) -> Rates:
        """Each stage's items done per second between consecutive readings."""
        out: Rates = {"times": [], "stages": {stage: [] for stage in self.stages}}
        for before, after in itertools.pairwise(self.samples):
            dt = after.time - before.time
            if dt <= 0:
                continue
            out["times"].append(after.time)
            for stage in self.stages:
                done = _done(after.stats.get(stage, {})) - _done(before.stats.get(stage, {}))
                # A counter that went down was reset (stats deleted): no rate there.
                out["stages"][stage].append(max(0.0, done) / dt)
        return out

    def latency(self, stage: str, now: dict[str, float]) -> Latency:
        """``stage``'s queue wait and run time percentiles since the reading about
        :data:`LATENCY_S` ago (all time when there is none yet), ``now`` being its
        counters as just read."""
        cutoff = self.clock.now() - LATENCY_S
        old = next((s for s in reversed(self.samples) if s.time <= cutoff), None)
        if old is None and self.samples:
            old = self.samples[0]
        then = old.stats.get(stage, {}) if old is not None else {}
        out: dict[str, Percentiles] = {}
        for name, key in (("queue_wait_seconds", "queue_wait"), ("run_seconds", "run")):
            counts = [
                max(0.0, b - a)
                for a, b in zip(_buckets(then, name), _buckets(now, name), strict=True)
            ]
            bounds = BUCKETS[name]
            out[key] = {"p50": quantile(bounds, counts, 0.5), "p99": quantile(bounds, counts, 0.99)}
        return {"queue_wait": out["queue_wait"], "run": out["run"]}
