"""The batch window: when the entries read so far go as one batch.

A batch closes when it is full or when ``batch_wait_ms`` has passed since its *oldest*
entry arrived (the stream id carries the arrival time); later arrivals never extend it.
With adaptive batching it goes sooner when waiting would not pay (:mod:`workers.policy`).
While an earlier batch holds the model, a batch could not start anyway: before its first
read and between its reads it gives the model time to free (:meth:`Window.look_pace_s`),
takes arrivals in a short read only when the model is still busy after that, and once it
frees reads once more without waiting (what came meanwhile, and what the reads held back
while it was busy: bulk work). A fast model's next batch is so read in one read after it
frees, not in a look per arrival.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pipelines.stages import Stage
from runtime.redisio import REDIS_DOWN, RedisClock, arrival
from runtime.stats import COST_A, COST_B
from workers.lanes import BUSY_BLOCK_MS
from workers.lengths import account
from workers.load import Load
from workers.policy import FLAT_OVERHEAD_TOKENS, OVERHEAD_PRIOR_TOKENS, BatchPolicy
from workers.settings import WorkerSettings
from workers.values import Batch, Entry, Ran

logger = logging.getLogger(__name__)

LOOK_PACE_S = 0.002
"""The least time between two looks for new entries while the model is busy: about what
its claim and a fast model's call take, so that a batch of echo-fast calls is read in one
read after the model frees, not in a look per arrival while it runs."""

Read = Callable[[int, int | None], Awaitable[list[Entry]]]
"""Reads up to ``count`` new entries, blocking up to ``block_ms`` (None: not at all)."""


class Window:
    """Assembles batches for one stage.

    Args:
        stage: the stage served (its batch bounds, unless the settings override them).
        settings: the worker's settings.
        read: how new entries are read.
        clock: the server's clock (arrival times are on it).
        load: the model's load (whether it is busy, how long a batch took).
        stopping: set when the worker stops: a batch being assembled goes as it is.

    Attributes:
        max_batch: the most entries in one batch.
        wait_s: the window, from the oldest entry's arrival.
        policy: the adaptive policy (None: always wait out the window).
    """

    def __init__(
        self,
        stage: Stage,
        settings: WorkerSettings,
        read: Read,
        clock: RedisClock,
        load: Load,
        stopping: asyncio.Event,
    ) -> None:
        self.max_batch = settings.max_batch_size or stage.max_batch_size
        wait_ms = stage.batch_wait_ms if settings.batch_wait_ms is None else settings.batch_wait_ms
        self.wait_s = wait_ms / 1000.0
        self.policy = BatchPolicy(self.max_batch) if settings.adaptive_batching else None
        max_tokens = settings.max_batch_tokens
        self.max_tokens = stage.max_batch_tokens if max_tokens is None else max_tokens
        self._stage = stage.name
        self._read = read
        self._clock = clock
        self._load = load
        self._stopping = stopping

    async def assemble(self, block_ms: int | None) -> list[Entry]:
        """The next batch; empty when nothing new came within ``block_ms``."""
        if self._load.busy and block_ms is not None:
            # This batch could not start before the model frees: it is given time to
            # first, as below (a read that may not wait, burst mode's, does not).
            await self._load.freed(self.look_pace_s())
        waited_on_model = bool(self._load.busy)  # a read while it is busy holds bulk back
        entries = await self._take(self.max_batch, block_ms)
        if not entries:
            return []
        # Not later than now: an id ahead of the clock would hold the window open for as
        # long as it is ahead (a forged future id makes every later id so).
        close_at = arrival(entries[0].id, self._clock.now()) + self.wait_s
        paced = False
        while len(entries) < self.max_batch and not self._stopping.is_set():
            now = self._clock.now()
            if self.policy and not self._load.busy and self.policy.go_now(len(entries), now):
                break  # waiting longer would not pay (see workers/policy.py)
            if self._load.busy and not paced:
                # Nothing read now could run before the model frees: it is given time to
                # (what comes meanwhile waits in the stream for one read then), and looked
                # at again only if it has not, a few times a run (a look a round trip).
                waited_on_model = paced = True
                await self._load.freed(self.look_pace_s())
                continue
            paced = False
            remaining_ms = int((close_at - now) * 1000)
            if remaining_ms < 1:
                if not self._load.busy:
                    break
                waited_on_model = True
                remaining_ms = max(1, min(BUSY_BLOCK_MS, int(self._load.last_run_s * 250)))
            more = await self._more(self.max_batch - len(entries), remaining_ms)
            if more is None:
                return entries
            entries += more
        if waited_on_model and len(entries) < self.max_batch and not self._load.busy:
            # The model is free now: what reads held back while it was busy (bulk, see
            # workers/lanes.py) fills the batch, without waiting.
            entries += await self._more(self.max_batch - len(entries), None) or []
        return entries

    def look_pace_s(self) -> float:
        """How long a batch being assembled waits for a busy model to free before it looks
        for new entries: a quarter of the last model call, within
        [:data:`LOOK_PACE_S`, :data:`~workers.lanes.BUSY_BLOCK_MS`]: a model that frees
        sooner is never looked past, one that runs long keeps its next batch filling."""
        return max(LOOK_PACE_S, min(BUSY_BLOCK_MS / 1000, self._load.last_run_s / 4))

    async def _more(self, count: int, block_ms: int | None) -> list[Entry] | None:
        """A read that fills a batch already begun; None when Redis refused it or could
        not be reached: what was read is pending under this consumer, so it runs now (its
        publish waits Redis out) instead of waiting for a reclaim."""
        try:
            return await self._take(count, block_ms)
        except REDIS_DOWN as exc:
            logger.warning("stage %s: read refused (%s); the batch closes", self._stage, exc)
            return None

    def learn(self, batch: Batch, ran: Ran) -> None:
        """``ran`` is what ``batch`` ran: its tokens are noted in its record and, unless it
        met a cold shape or was cut short, its cost is learned, per item or, on a
        length-aware stage, per padded token."""
        padded = account(batch.record, ran.items, self._load.input_cap)
        if self.policy is not None and ran.sample:
            units = padded if self.max_tokens else len(ran.items)
            self.policy.observe(len(ran.items), units, ran.run_s)

    def overhead_tokens(self) -> float:
        """A batch's learned fixed cost in tokens (:mod:`workers.lengths` splits by it)."""
        # The prior is the device's: on an accelerator a batch's cost is nearly flat in
        # its tokens until saturation (a split would only add batches); on a CPU, not.
        prior = FLAT_OVERHEAD_TOKENS if self._load.accelerated else OVERHEAD_PRIOR_TOKENS
        return self.policy.batch_overhead_tokens(prior) if self.policy else prior

    def gauges(self) -> dict[str, float] | None:
        """The learned cost model per item, for the gateway's admission (see
        gateway/admission.py)."""
        if self.policy is None or not self.policy.cost.known:
            return None
        a, b = self.policy.per_item_cost()
        return {COST_A: a, COST_B: b}

    async def _take(self, count: int, block_ms: int | None) -> list[Entry]:
        entries = await self._read(count, block_ms)
        if self.policy is not None:
            now = self._clock.now()
            for entry in entries:
                self.policy.arrivals.observe(arrival(entry.id, now))
        return entries
