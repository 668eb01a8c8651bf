"""The batch loop: read entries, close a window's worth into a batch, run it, publish.

One worker serves one stage. It reads with XREADGROUP in its stage's consumer group,
so starting another worker is all scaling out takes; it reads every lane's stream of the
stage, interactive first (:mod:`workers.lanes`). When a batch closes is the window's
to say (:mod:`workers.window`); the model runs in a thread, one batch at a time, while
the loop assembles the next (:class:`workers.runner.Runner`). Each batch's replies, its
XACK and its stats increments go in one atomic script call (:mod:`workers.publish`);
then one observer reports it (:class:`workers.report.Reporter`). Entries a worker left
behind are :mod:`workers.recovery`'s.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket

from redis.exceptions import ResponseError

from pipelines.envelope import LANES
from pipelines.graph import single
from pipelines.model import Model
from pipelines.registry import Registry
from pipelines.stages import Stage
from runtime.redisio import (
    REDIS_DOWN,
    RedisClock,
    agree_on_partitions,
    connect,
    until_reachable,
)
from workers.alive import AliveFile, Presence
from workers.batch import Batch, Entry
from workers.decoding import serve
from workers.intake import Intake
from workers.lanes import Lanes
from workers.lengths import Lengths, input_cap
from workers.publish import Publisher
from workers.recovery import Recovery, Settled
from workers.report import Reporter, Summary
from workers.route import Router
from workers.runner import Runner, Seat
from workers.settings import WorkerSettings
from workers.source import Source
from workers.window import Window

logger = logging.getLogger(__name__)


def consumer_name() -> str:
    """A consumer name unique to this process: host-pid-random."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Worker:
    """Serves one stage until stopped.

    Each batch goes: source (:class:`Source`: a reclaimed suspect alone, else what the
    :class:`Window` closed, cut by length; dead letters recovery ended are published
    first) → intake (:class:`Intake`: decoded, admitted) → run (:meth:`Runner.run`:
    prepared on the host, launched in its turn once the requests cancelled meanwhile are
    withdrawn, finished after it, its cost learned) → route (:meth:`Router.route_all`)
    → publish with its ack (:class:`Publisher`) → report (:class:`Reporter`).

    Args:
        stage: the stage to serve.
        settings: the worker's settings.
        model: an already-built model (tests, embedding); built from the stage if None.
        registry: the pipelines whose steps run on this stage (default: the stage alone).
        partition: the partition of the stage's streams it reads (:mod:`pipelines.keys`);
            everything it writes for a request stays in that partition.
        runner: the model runner of another partition's worker of the same stage in this
            process (:func:`partition_workers`): the model is loaded once and their
            batches take turns on it.
        consumer: its consumer name (default: the settings', else a fresh one).
        summary: the stage's periodic INFO summary, shared with its other partitions'
            workers in this process (default: its own).

    Attributes:
        consumer: this worker's consumer name in the stage's group.
        streams: the stage's stream of each lane (interactive first), all read.
        history: what the recent batches did (tests, introspection).
    """

    def __init__(
        self,
        stage: Stage,
        settings: WorkerSettings,
        model: Model | None = None,
        registry: Registry | None = None,
        *,
        partition: int = 0,
        runner: Runner | None = None,
        consumer: str | None = None,
        summary: Summary | None = None,
    ) -> None:
        self.stage, self.settings = stage, settings
        self.keys = keys = settings.keys.at(partition)
        self.streams = streams = [keys.stage_stream(stage.name, lane) for lane in LANES]
        self.consumer = me = consumer or settings.consumer_name or consumer_name()
        self.client = client = connect(settings, block_ms=settings.block_ms)
        self.clock = clock = RedisClock()
        self.router = router = Router(registry or Registry([single(stage)]), keys, stage.name)
        self._owns_runner = runner is None
        self.runner = runner = runner or Runner(stage, settings, model)
        max_batch = settings.max_batch_size or stage.max_batch_size
        self.lanes = Lanes(client, streams, me, max_batch, settings.bulk_every, runner)
        self._stopping = asyncio.Event()
        self.alive = AliveFile(settings.alive_file)
        self.presence = Presence(client, keys, stage.name, me, clock, settings.alive_stale_s)
        self.window = Window(stage, settings, self.lanes.read, clock, runner, self._stopping)
        args = (client, streams, me, settings, router, clock)
        self.recovery = Recovery(*args, claim_count=max_batch)
        self.publish = Publisher(client, router, me, settings)
        self.intake = Intake(client, stage, router, self.recovery)
        max_tokens = settings.max_batch_tokens
        if max_tokens is None:
            max_tokens = stage.max_batch_tokens
        self.lengths = (
            Lengths(max_tokens, self.window.overhead_tokens, lambda: input_cap(runner.model))
            if max_tokens
            else None
        )
        parts = (self.window, self.lanes, self.recovery, self.lengths)
        self.source = Source(client, keys, stage.name, streams, *parts)
        aware = self.lengths is not None
        self.seat = Seat(client, keys, settings, clock, self.intake, self.window, aware)
        self.summary = summary = summary or Summary(stage.name, settings.log_summary_s)
        gauges = self.window.gauges
        self.report = Reporter(stage.name, me, clock, summary, runner.breaches, gauges)
        self.history = self.report.history
        self._joined = False  # the clock calibrated and the group there
        self._fatal: BaseException | None = None  # a batch's unexpected failure ends run()

    def stop(self) -> None:
        """Ask the loop to see its in-flight batches through and return."""
        self._stopping.set()

    async def start(self) -> None:
        """Load the model (once, its shape buckets warmed), then calibrate the clock,
        check the partition count and create the group; while Redis cannot be reached,
        wait for it (or for :meth:`stop`).

        Raises:
            ConfigError: the namespace runs with another partition count.
        """
        # The stage is registered and its group joined only once the model is warm, so
        # no request waits on a load or meets a cold shape (workers/models/buckets.py).
        await self.runner.load()
        # Like the gateway, a worker started before Redis (or during an outage) waits
        # for it, until stopped (then it returns, not joined).
        if not self._joined:
            await until_reachable(self._join, f"stage {self.stage.name}", self._stopping)

    async def _join(self) -> None:
        await self.clock.calibrate(self.client)
        await agree_on_partitions(self.client, self.settings.keys)
        await self.source.ensure_stream()
        self._joined = True

    async def close(self) -> None:
        """Release the connection and the model thread (if it is this worker's)."""
        await self.client.aclose()
        if self._owns_runner:
            self.runner.close()

    async def run(self, *, max_batches: int | None = None, burst: bool = False) -> int:
        """Serve until stopped; returns the number of batches run.

        Args:
            max_batches: stop after this many batches (tests, benchmarks).
            burst: stop once the stream has nothing new to deliver.
        """
        await self.start()
        if not self._joined:  # stopped while waiting for Redis
            return 0
        logger.info(
            "stage %s: consumer %s reading %s (batch<=%d, wait %.1f ms)",
            self.stage.name,
            self.consumer,
            ", ".join(self.streams),
            self.window.max_batch,
            self.window.wait_s * 1000,
        )
        decoder = await self.runner.decoder()
        if decoder is not None:
            return await serve(self, decoder, self._stopping, max_batches, burst)
        slots = asyncio.Semaphore(self.settings.max_concurrent_batches)
        tasks: set[asyncio.Task[None]] = set()
        # Its own heartbeat says it is alive, idle or not (Redis's idle time cannot).
        self.presence.start()
        batches = 0

        def spawn(entries: list[Entry], suspect: bool) -> None:
            task = asyncio.create_task(self._process(entries, suspect))
            tasks.add(task)
            task.add_done_callback(lambda t: self._batch_ended(t, tasks, slots))

        try:
            while not self._stopping.is_set() and (max_batches is None or batches < max_batches):
                await slots.acquire()
                taken = await self.source.next(None if burst else self.settings.block_ms)
                self.alive.beat()
                self.summary.tick()
                if self._fatal is not None:
                    raise self._fatal
                if taken.settled is not None:
                    await self.settle(taken.settled)
                if not taken.batches:
                    slots.release()
                    if burst and taken.settled is None:
                        break
                    continue
                if taken.suspect and tasks:
                    # Alone on the model: a crash while it runs is its own, no other
                    # batch of this worker is there to be charged with it.
                    await asyncio.wait(set(tasks))
                spawn(taken.batches[0], taken.suspect)
                for group in taken.batches[1:]:  # each takes a slot
                    await slots.acquire()
                    spawn(group, False)
                batches += len(taken.batches)
            held = self.lanes.release() if self._stopping.is_set() else []
            if held:  # delivered here past a batch's bound (rare): run, not left pending
                await slots.acquire()
                spawn(held, False)
        finally:
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            await self.presence.stop(leave=self._stopping.is_set() or burst)
            self.summary.tick(last=True)
        if self._fatal is not None:
            raise self._fatal
        if self._stopping.is_set():
            await self.recovery.leave()
        return batches

    def _batch_ended(
        self, task: asyncio.Task[None], tasks: set[asyncio.Task[None]], slots: asyncio.Semaphore
    ) -> None:
        tasks.discard(task)
        slots.release()
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, REDIS_DOWN):
            # Entries stay pending in the group; they are redelivered, not lost.
            logger.warning(
                "stage %s: could not publish a batch, redis unreachable: %s", self.stage.name, exc
            )
        elif exc is not None:
            logger.error("stage %s: batch task failed", self.stage.name, exc_info=exc)
            self._fatal = exc
            self._stopping.set()

    async def settle(self, settled: Settled) -> None:
        """Publish the dead letters recovery ended (answered, acked, kept); a publish that
        fails is the source's to wait out, as a failed read."""
        try:
            await self.publish(*settled)
        except (*REDIS_DOWN, ResponseError) as exc:
            await self.source.failed(exc)
            return
        self.recovery.published(settled)

    async def _process(self, entries: list[Entry], suspect: bool) -> None:
        # Its entries are kept fresh until they are published: a batch whose publish
        # waits out Redis is not reclaimed from a worker that is alive.
        heartbeat = self.recovery.heartbeat(entries)
        try:
            batch = self.intake.open(entries, self.clock.now())
            await self.runner.run(batch, self.seat)
            self.router.route_all(batch, self.clock.now())
            await self._publish(batch)
        finally:
            await heartbeat.stop()
            if suspect:
                self.recovery.suspect_done()

    async def _publish(self, batch: Batch) -> None:
        """Publish and ack the batch with its stats increments, then report it."""
        counts, gauges = self.report.counts(batch)
        published = await self.publish(
            batch.out, batch.entries, counts, batch.letters, gauges, batch.dropped
        )
        self.report.published(batch, published)
