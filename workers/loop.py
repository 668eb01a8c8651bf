"""The batch loop: one worker serves one stage, a batch at a time through one step.

Each batch goes, in :meth:`Worker._process`: lease its entries → open (decode, admit) →
run on the model → learn its cost → route its results → publish with its ack → report.
Where batches come from (reclaimed suspects, else the window) is the source's;
the walk of one batch is drawn in docs/how-it-works.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import socket

from redis.exceptions import ResponseError

from pipelines.errors import ConfigError
from pipelines.model import Model
from pipelines.registry import Registry
from pipelines.stages import Stage
from runtime.definitions import agree_on_definition
from runtime.redisio import REDIS_DOWN, agree_on_partitions, until_reachable
from workers.decoding import Decoding
from workers.modelthread import Hung
from workers.parts import Parts
from workers.report import Summary
from workers.runner import Runner
from workers.settings import WorkerSettings
from workers.threads import runs_torch_on_cpu
from workers.values import Entry

logger = logging.getLogger(__name__)


def consumer_name() -> str:
    """A consumer name unique to this process: host-pid-random."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Worker:
    """Serves one stage until stopped.

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
        parts: what it runs with (:class:`~workers.parts.Parts`), built once.
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
        self.consumer = consumer or settings.consumer_name or consumer_name()
        self._stopping = asyncio.Event()
        self._owns_runner = runner is None
        self.parts = parts = Parts(
            stage,
            settings,
            model,
            registry,
            partition=partition,
            runner=runner,
            consumer=self.consumer,
            summary=summary,
            stopping=self._stopping,
        )
        self.streams, self.runner, self.summary = parts.streams, parts.runner, parts.summary
        self.history = parts.report.history
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
        parts = self.parts
        await parts.clock.calibrate(parts.client)
        await agree_on_partitions(parts.client, self.settings.keys)
        replace = self.settings.replace_stage_definition
        # Its model loaded: whether it runs torch on the CPU, which a worker started by
        # hand on its host counts when it divides the cores (workers/threads.py).
        parts.presence.cpu_model = runs_torch_on_cpu()
        try:  # beat first: a worker starting beside it sees it live
            await parts.presence.beat()
        except ResponseError as exc:  # the key forged to another type
            logger.warning("stage %s: could not beat: %s", self.stage.name, exc)
        try:
            await agree_on_definition(
                parts.client, self.settings.keys, self.stage, self.consumer, replace=replace
            )
        except ConfigError:
            await parts.presence.stop(leave=True)  # refused: not live, not counted
            raise
        await parts.source.ensure_stream()
        self._joined = True

    async def close(self) -> None:
        """Release the connection and the model thread (if it is this worker's)."""
        await self.parts.client.aclose()
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
        parts = self.parts
        logger.info(
            "stage %s: consumer %s reading %s (batch<=%d, wait %.1f ms)",
            self.stage.name,
            self.consumer,
            ", ".join(self.streams),
            parts.window.max_batch,
            parts.window.wait_s * 1000,
        )
        decoder = await self.runner.decoder()
        if decoder is not None:
            return await Decoding(parts, decoder).serve(self._stopping, max_batches, burst)
        # An itemwise model's (a function step's) batches are one item each, run apart,
        # as many at once as it runs calls (each partition its share, rounded up).
        apart = self.runner.concurrency
        limit = self.settings.max_concurrent_batches
        if apart is not None:
            limit = math.ceil(apart / self.settings.partitions)
            # Jobs (bulk) hold at most three quarters of the calls: slow ones never
            # keep interactive requests from being read (one slot: no reserve).
            parts.lanes.bulk_cap = max(1, limit - max(1, limit // 4)) if limit > 1 else None
        slots = asyncio.Semaphore(limit)
        tasks: set[asyncio.Task[None]] = set()
        # Its own heartbeat says it is alive, idle or not (Redis's idle time cannot).
        parts.presence.start()
        batches = 0

        lanes = parts.lanes

        def spawn(entries: list[Entry], suspect: bool, slotted: bool = True) -> None:
            task = asyncio.create_task(self._process(entries, suspect))
            tasks.add(task)
            held = slots if slotted else None
            bulk = sum(1 for e in entries if e.stream == lanes.bulk)
            lanes.bulk_held += bulk

            def ended(t: asyncio.Task[None]) -> None:
                lanes.bulk_held -= bulk
                self._batch_ended(t, tasks, held)

            task.add_done_callback(ended)

        try:
            while not self._stopping.is_set() and (max_batches is None or batches < max_batches):
                await slots.acquire()
                taken = await parts.source.next(None if burst else self.settings.block_ms)
                parts.alive.beat()
                parts.summary.tick()
                if self._fatal is not None:
                    raise self._fatal
                if taken.settled is not None:
                    await parts.settle(taken.settled)
                if not taken.batches:
                    slots.release()
                    await parts.flush()  # idle: what the batches counted goes out
                    if burst and taken.settled is None:
                        break
                    continue
                # Suspects in a child process (workers.suspects) crash only the child:
                # they take no slot, and the worker serves on beside them.
                isolated = taken.suspect and parts.isolation.usable
                if taken.suspect and tasks and not isolated:
                    # Alone on the model: a crash while it runs is its own, no other
                    # batch of this worker is there to be charged with it (those read
                    # meanwhile are marked at their turn, after it).
                    await asyncio.wait(set(tasks))
                groups = taken.batches
                if apart is not None and not taken.suspect:
                    groups = [[entry] for group in groups for entry in group]
                spawn(groups[0], taken.suspect, slotted=not isolated)
                if isolated:
                    slots.release()
                # Those waiting for a slot are this worker's too: kept from looking idle.
                rest = [entry for group in groups[1:] for entry in group]
                waiting = parts.recovery.lease(rest) if rest else None
                try:
                    for group in groups[1:]:  # each takes a slot
                        await slots.acquire()
                        spawn(group, False)
                finally:
                    if waiting is not None:
                        await waiting.stop()
                batches += len(groups)
            held = parts.lanes.release() if self._stopping.is_set() else []
            if held:  # delivered here past a batch's bound (rare): run, not left pending
                await slots.acquire()
                spawn(held, False)
        finally:
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            await parts.flush(bounded=True)
            await parts.presence.stop(leave=self._stopping.is_set() or burst)
            parts.summary.tick(last=True)
        if self._fatal is not None:
            raise self._fatal
        if self._stopping.is_set():
            await parts.recovery.leave()
        return batches

    def _batch_ended(
        self,
        task: asyncio.Task[None],
        tasks: set[asyncio.Task[None]],
        slots: asyncio.Semaphore | None,
    ) -> None:
        tasks.discard(task)
        if slots is not None:
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
        """One batch, from its entries to its report: the worker's step."""
        parts = self.parts
        # Held until published: a batch whose publish waits Redis out is not reclaimed
        # from a worker that is alive.
        lease = parts.recovery.lease(entries)
        try:
            batch = parts.intake.open(entries, parts.clock.now())
            if batch.live:
                deadline = parts.deadline([req for req, _ in batch.live])
                try:
                    apart = suspect or parts.recovery.quarantined()  # after a crash
                    if apart and parts.isolation.usable:  # in a child process
                        hung = parts.recovery.from_hang(entries)
                        ran = await parts.isolation.run(batch, parts, deadline, hung=hung)
                    else:
                        ran = await parts.runner.run(batch, parts, deadline)
                except Hung as hung:  # its thread is lost: the process ends
                    await parts.hung(batch)
                    hung.exit()
                if ran is not None:
                    batch.took(ran, parts.clock.now())
                    parts.window.learn(batch, ran)
                    parts.router.route_all(batch, parts.clock.now())
            await parts.send([batch])
        finally:
            await lease.stop()
            if suspect:
                parts.recovery.suspect_done()
