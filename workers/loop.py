"""The batch loop: read entries, close a window's worth into a batch, run it, publish.

One worker serves one stage. It reads with XREADGROUP in its stage's consumer group,
so starting another worker is all scaling out takes; it reads every lane's stream of the
stage, interactive first (:mod:`workers.lanes`). When a batch closes is the window's
to say (:mod:`workers.window`); the model runs in a thread, one batch at a time, while
the loop assembles the next (:class:`workers.runner.Runner`). Each batch's replies, its
XACK and its stats increments go in one atomic script call (:mod:`workers.publish`).
Entries a worker left behind are :mod:`workers.recovery`'s.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections import deque
from typing import TYPE_CHECKING

from pipelines.envelope import LANES
from pipelines.graph import single
from pipelines.model import Model
from pipelines.registry import Registry
from pipelines.stages import Stage
from runtime import tracing
from runtime.redisio import (
    REDIS_DOWN,
    RedisClock,
    agree_on_partitions,
    connect,
    until_reachable,
)
from runtime.stats import CONTRACT
from workers.alive import AliveFile, Presence
from workers.batch import BatchRecord, Entry
from workers.crashes import mark_now
from workers.decoding import Decoding
from workers.intake import Batch, Intake
from workers.lanes import Lanes
from workers.lengths import Lengths, account, input_cap
from workers.partials import Partials
from workers.publish import Publisher
from workers.recovery import Recovery
from workers.report import Summary, batch_counts, log_batch, tally
from workers.route import Router
from workers.runner import Runner, overlapped
from workers.settings import WorkerSettings
from workers.source import Source
from workers.spans import record_batch
from workers.window import Window

if TYPE_CHECKING:
    from workers.models.decoder import Decoder

logger = logging.getLogger(__name__)


def consumer_name() -> str:
    """A consumer name unique to this process: host-pid-random."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Worker:
    """Serves one stage until stopped.

    Each batch goes: source (:class:`Source`: a reclaimed suspect alone, else what the
    :class:`Window` closed, cut by length) → intake (:class:`Intake`: decoded, admitted)
    → run (:class:`Runner`: prepared on the host, launched in its turn once the requests
    cancelled meanwhile are withdrawn, finished after it) → route (:meth:`Router.finish`)
    → publish with its ack (:class:`Publisher`).

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
        self.keys = settings.keys.at(partition)
        self.streams = [self.keys.stage_stream(stage.name, lane) for lane in LANES]
        self.consumer = consumer or settings.consumer_name or consumer_name()
        self.client = connect(settings, block_ms=settings.block_ms)
        self.clock = RedisClock()
        self.router = Router(registry or Registry([single(stage)]), self.keys, stage.name)
        self._owns_runner = runner is None
        self.runner = runner or Runner(stage, settings, model)
        max_batch = settings.max_batch_size or stage.max_batch_size
        self.lanes = Lanes(
            self.client, self.streams, self.consumer, max_batch, settings.bulk_every, self.runner
        )
        self._stopping = asyncio.Event()
        self.alive = AliveFile(settings.alive_file)
        self.presence = Presence(
            self.client, self.keys, stage.name, self.consumer, self.clock, settings.alive_stale_s
        )
        self.window = Window(
            stage, settings, self.lanes.read, self.clock, self.runner, self._stopping
        )
        self.recovery = Recovery(
            self.client,
            self.streams,
            self.consumer,
            settings,
            self.router,
            self.clock,
            claim_count=max_batch,
        )
        self.publish = Publisher(self.client, self.router, self.consumer, settings)
        self.intake = Intake(self.client, stage, self.router, self.recovery)
        max_tokens = settings.max_batch_tokens
        if max_tokens is None:
            max_tokens = stage.max_batch_tokens
        self.lengths = (
            Lengths(max_tokens, self.window.overhead_tokens, lambda: input_cap(self.runner.model))
            if max_tokens
            else None
        )
        self.source = Source(
            self.client,
            self.keys,
            stage.name,
            self.streams,
            self.window,
            self.lanes,
            self.recovery,
            self.lengths,
            self.publish,
        )
        self.history: deque[BatchRecord] = deque(maxlen=10_000)
        self.summary = summary or Summary(stage.name, settings.log_summary_s)
        self._joined = False  # the clock calibrated and the group there
        self._fatal: BaseException | None = None  # a batch's unexpected failure ends run()

    def stop(self) -> None:
        """Ask the loop to finish its in-flight batches and return."""
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
            return await self._decode(decoder, max_batches, burst)
        slots = asyncio.Semaphore(self.settings.max_concurrent_batches)
        tasks: set[asyncio.Task[None]] = set()
        # Its own heartbeat says it is alive, idle or not (Redis's idle time cannot).
        self.presence.start()
        batches = 0

        def spawn(entries: list[Entry], suspect: bool) -> None:
            task = asyncio.create_task(self._process(entries, suspect))
            tasks.add(task)
            task.add_done_callback(lambda t: self._finished(t, tasks, slots))

        try:
            while not self._stopping.is_set() and (max_batches is None or batches < max_batches):
                await slots.acquire()
                taken = await self.source.next(None if burst else self.settings.block_ms)
                self.alive.beat()
                self.summary.tick()
                if self._fatal is not None:
                    raise self._fatal
                if not taken.batches:
                    slots.release()
                    if burst:
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

    async def _decode(self, decoder: Decoder, max_batches: int | None, burst: bool) -> int:
        """Serve by continuous decoding (:mod:`workers.decoding`) instead of batches;
        returns the number of publishes."""
        logger.info(
            "stage %s: continuous decoding, up to %d sequences and %d cache positions",
            self.stage.name,
            self.window.max_batch,
            decoder.budget,
        )
        self.presence.start()
        try:
            published = await Decoding(self, decoder).run(self._stopping, max_batches, burst)
        finally:
            await self.presence.stop(leave=self._stopping.is_set() or burst)
            self.summary.tick(last=True)
        if self._stopping.is_set():
            await self.recovery.leave()
        return published

    def _finished(
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

    async def _process(self, entries: list[Entry], suspect: bool) -> None:
        # Its entries are kept fresh until they are published: a batch whose publish
        # waits out Redis is not reclaimed from a worker that is alive.
        heartbeat = self.recovery.heartbeat(entries)
        try:
            batch = self.intake.open(entries, self.clock.now())
            if batch.live:
                await self._run_model(batch)
                done = self.clock.now()
                for (req, _), result in zip(batch.live, batch.results, strict=True):
                    self.router.finish(batch.out, req, result, done)
            await self._publish_batch(batch)
        finally:
            await heartbeat.stop()
            if suspect:
                self.recovery.suspect_done()

    async def _run_model(self, batch: Batch) -> None:
        """Run the live items on the model, streaming partial output as it comes.

        A staged model prepares the batch before its turn, beside the batch on the
        device (:class:`~workers.runner.Runner`). Once the model is the batch's (its
        turn), the requests cancelled while it waited are withdrawn and never run (one
        round trip, which also marks its entries on the model: workers/crashes.py); its
        results are made after the turn, while the next batch launches."""
        partials: Partials | None = None
        deadline = time.monotonic() + max(r.deadline for r, _ in batch.live) - self.clock.now()
        try:
            staged = overlapped(self.runner.model)
            if staged:  # its host phase runs user code before its turn
                await mark_now(self.client, self.keys, batch.entries)
            prepared = await self.runner.prepare([item for _, item in batch.live], deadline)
            async with self.runner.turn():
                # Marked on the model (workers/crashes.py) in the same round trip.
                await self.intake.withdraw_cancelled(batch, self.clock.now(), mark=not staged)
                if not batch.live:
                    return
                requests = [req for req, _ in batch.live]
                loop = asyncio.get_running_loop()
                partials = Partials(self.client, requests, self.settings, loop, self.keys)
                items = [item for _, item in batch.live]
                emit = partials.emit if partials.wanted else None
                launched = await self.runner.launch(items, emit, deadline, prepared)
            ran = await self.runner.finish(launched)
            batch.results, batch.record.run_s = ran.results, ran.run_s
            for result in ran.results:  # said and counted, then failed alone (route.py)
                if not isinstance(result, dict | BaseException):
                    self.runner.breaches.note(f"a result is {type(result).__name__}")
            batch.record.cold = ran.cold
            batch.record.ran_at = self.clock.now()
        finally:
            if partials is not None:
                await partials.close()  # every partial is out before the final reply
        padded = account(batch.record, items, input_cap(self.runner.model))
        if ran.sample:  # a cold shape's first call is not the model's cost
            units = padded if self.lengths is not None else len(items)
            self.window.learn(len(items), units, batch.record.run_s)

    async def _publish_batch(self, batch: Batch) -> None:
        """Publish and ack the batch, count it, log it (DEBUG) and add it to the stage's
        summary (INFO)."""
        counts, gauges = batch_counts(batch), self.window.gauges()
        breaches = self.runner.breaches.take()  # logged here, at most one line a minute
        if breaches:
            counts[CONTRACT] = breaches
        published = await self.publish(
            batch.out, batch.entries, counts, batch.letters, gauges, batch.dropped
        )
        tally(batch, published)
        self.history.append(batch.record)
        if tracing.STATE.enabled:
            record_batch(self.stage.name, batch, self.clock.now(), self.consumer)
        log_batch(self.stage.name, batch)
        self.summary.add(batch.record)
