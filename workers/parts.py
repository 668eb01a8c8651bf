"""One worker's parts, built once, and what both of its loops share: settling recovery's
dead letters, publishing a batch and reporting it, and the hooks a run calls around the
model. The static loop (:mod:`workers.loop`) and continuous decoding
(:mod:`workers.decoding`) take this object; neither reaches into the other."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from redis.exceptions import ResponseError

from pipelines.envelope import Request
from pipelines.graph import single
from pipelines.keys import LANES
from pipelines.model import Model
from pipelines.registry import Registry
from pipelines.stages import Stage
from runtime.redisio import REDIS_DOWN, RedisClock, connect
from workers import claims
from workers.alive import AliveFile, Presence
from workers.intake import Intake
from workers.lanes import Lanes
from workers.lengths import Lengths
from workers.partials import Partials
from workers.publish import Publisher
from workers.recovery import Recovery
from workers.report import Reporter, Summary
from workers.route import Router
from workers.runner import Runner
from workers.settings import WorkerSettings
from workers.source import Source
from workers.suspects import Isolation
from workers.values import Batch, Emitter, Outbox, Published, Settled
from workers.window import Window

logger = logging.getLogger(__name__)

LAST_WORDS_S = 2.0
"""How long a worker that ends tries a last write (its hung batch's marks, its held-back
counts) before it gives up on Redis."""


class Parts:
    """Everything one worker of a stage's partition runs with (see :class:`Worker
    <workers.loop.Worker>` for the arguments)."""

    def __init__(
        self,
        stage: Stage,
        settings: WorkerSettings,
        model: Model | None,
        registry: Registry | None,
        *,
        partition: int,
        runner: Runner | None,
        consumer: str,
        summary: Summary | None,
        stopping: asyncio.Event,
    ) -> None:
        self.stage, self.settings, self.consumer = stage, settings, consumer
        self.keys = keys = settings.keys.at(partition)
        self.streams = streams = [keys.stage_stream(stage.name, lane) for lane in LANES]
        self.client = client = connect(settings, block_ms=settings.block_ms)
        self.clock = clock = RedisClock()
        routed = registry or Registry([single(stage)])
        self.router = router = Router(routed, keys, stage.name, settings.max_result_bytes)
        self.runner = runner = runner or Runner(stage, settings, model)
        max_batch = settings.max_batch_size or stage.max_batch_size
        self.lanes = Lanes(client, streams, consumer, max_batch, settings.bulk_every, runner)
        self.alive = AliveFile(settings.alive_file)
        self.presence = Presence(client, keys, stage.name, consumer, clock, settings.alive_stale_s)
        self.window = Window(stage, settings, self.lanes.read, clock, runner, stopping)
        args = (client, streams, consumer, settings, router, clock)
        self.recovery = recovery = Recovery(*args, claim_count=max_batch)
        self.publisher = Publisher(client, keys, stage.name, consumer, settings, recovery.set_aside)
        self.intake = Intake(client, stage, router, recovery.unreadable)
        # Suspects (a crashed batch's entries) run in a child process where it can fork.
        self.isolation = Isolation(runner, router, client, consumer, settings)
        max_tokens = self.window.max_tokens
        overhead = self.window.overhead_tokens
        self.lengths = (
            Lengths(max_tokens, overhead, lambda: runner.input_cap) if max_tokens else None
        )
        parts = (self.window, self.lanes, recovery, self.lengths)
        self.source = Source(client, keys, stage.name, streams, *parts)
        self.summary = summary = summary or Summary(stage.name, settings.log_summary_s)
        gauges = self.window.gauges
        breaches, flush_s = runner.breaches, settings.stats_flush_s
        self.report = Reporter(stage.name, consumer, clock, summary, breaches, gauges, flush_s)

    async def settle(self, settled: Settled) -> None:
        """Publish the dead letters recovery ended (answered, acked, kept); a publish that
        fails is the source's to wait out, as a failed read."""
        try:
            await self.publisher(*settled)
        except (*REDIS_DOWN, ResponseError) as exc:
            await self.source.failed(exc)
            return
        self.recovery.published(settled)

    async def send(self, batches: Iterable[Batch]) -> Published | None:
        """Publish ``batches`` and ack their entries in one call with their stats, then
        report each; None when Redis could not be reached (their entries stay pending,
        reclaimed once idle: nothing is lost)."""
        batches = list(batches)
        out, entries, letters, dropped = Batch.merged(batches)
        counts: dict[str, float] = {}
        gauges = None
        for batch in batches:
            counted, gauges = self.report.counts(batch)
            for name, value in counted.items():
                counts[name] = counts.get(name, 0) + value
        try:
            published = await self.publisher(out, entries, counts, letters, gauges, dropped)
        except REDIS_DOWN as exc:
            self.report.unsent(counts)
            logger.warning(
                "stage %s: could not publish %d entries, redis unreachable: %s",
                self.stage.name,
                len(entries),
                exc,
            )
            return None
        for batch in batches:
            self.report.published(batch, published)
        return published

    async def flush(self, *, bounded: bool = False) -> None:
        """Send the stats counts held back (:meth:`Reporter.counts`), if any: when the
        worker is idle or stops (one publish call of its own; ``bounded``: given up
        after :data:`LAST_WORDS_S`, as a stopping worker does not wait Redis out)."""
        counts, gauges = self.report.held()
        if not counts:
            return
        try:
            async with asyncio.timeout(LAST_WORDS_S if bounded else None):
                await self.publisher(Outbox(), [], counts, (), gauges)
        except (TimeoutError, *REDIS_DOWN, ResponseError) as exc:
            self.report.unsent(counts)
            logger.warning("stage %s: stats not sent: %s", self.stage.name, exc)

    def deadline(self, requests: Iterable[Request]) -> float:
        """``time.monotonic()`` of the latest deadline among ``requests``."""
        return self.clock.monotonic(max(r.deadline for r in requests))

    async def hung(self, batch: Batch) -> None:
        """Mark ``batch``'s entries as on the model in a call that hung, for whoever
        takes them back (:mod:`workers.recovery`: one alone is dead-lettered, several
        run again in halves); one round trip, bounded: the process ends next."""
        try:
            async with asyncio.timeout(LAST_WORDS_S):
                await claims.mark_hung(self.client, self.keys, batch.entries)
        except (TimeoutError, *REDIS_DOWN) as exc:  # reclaimed as an ordinary crash
            logger.warning("stage %s: a hung batch not marked: %s", self.stage.name, exc)

    # -- the hooks a run calls around the model (workers.values.Turn) --------------

    async def before_host(self, batch: Batch) -> None:
        """Mark ``batch``'s entries on the model in a round trip of its own: a staged
        model's host phase runs user code before its turn."""
        await claims.mark_now(self.client, self.keys, batch.entries)

    async def at_turn(self, batch: Batch, *, mark: bool) -> Emitter | None:
        """The model is ``batch``'s: the requests cancelled meanwhile are withdrawn (one
        round trip, which with ``mark`` also marks its entries on the model); the
        partials its streaming requests are sent through."""
        await self.intake.withdraw_cancelled(batch, self.clock.now(), mark=mark)
        if not batch.live:
            return None
        requests = [req for req, _ in batch.live]
        if not any(req.stream for req in requests):
            return None
        loop = asyncio.get_running_loop()
        return Partials(self.client, requests, self.settings, loop, self.keys)

    async def cancelled(self, request_ids: list[str]) -> set[str]:
        """Which of ``request_ids`` are cancelled by now (one round trip), their calls
        running (an itemwise model's: :meth:`workers.runner.Runner.apart`)."""
        return await self.intake.cancelled([], request_ids, mark=False)
