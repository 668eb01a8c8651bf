"""Suspects run apart: the entries of a batch that crashed its worker run again in a
short-lived child process, forked from the worker with its model loaded, so an input
that kills its process kills the child, never the worker that serves everyone else.

A crash costs the worker one restart (the crash itself, which :mod:`workers.recovery`
charges to the batch on the model). The batch then runs again here: the child runs the
model on it (copy-on-write: no second load) and writes its results, encoded as JSON, to
a pipe, while the worker goes on reading and running other batches. A child that dies
(a signal, a non-zero exit) or runs past the stage's longest call (killed) held the
input that kills: its items run again in halves, each in a child of its own (side by
side), until the input is alone; it is then dead-lettered and its caller answered (500,
or 504 for a call that never returned), and every other item publishes its result. A
batch whose call hung (in the worker, or in a child) runs each item in a child of its
own instead: a level of halves would wait the whole bound out again each time.

The child's mechanics (fork, pipe, encoding, wait) are in :mod:`workers.forked`.

A fork needs the model idle (no thread inside it, so no lock of its held in the child):
each child is forked in a turn of the model (:meth:`workers.runner.Runner.turn`), which
it leaves at once. The child runs only the model and writes to its pipe: it never
touches the worker's Redis connections or event loop, and ends with ``os._exit``.

Where a fork is not safe or not there, suspects run in the worker as before
(:meth:`Isolation.usable`): on an accelerator (CUDA cannot be forked), an itemwise model
(its items run apart already), no ``os.fork`` (Windows, macOS's spawn), or
``CONVEYOR_SUSPECTS_IN_CHILD=false``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from pipelines.envelope import sender
from pipelines.errors import (
    ConveyorError,
    DeadlineExceeded,
)
from pipelines.model import Item, ItemwiseModel
from runtime.redisio import REDIS_DOWN
from workers.claims import deliveries
from workers.forked import decode_results, ended, fork_running, wait_child
from workers.recovery import letter
from workers.route import Router
from workers.runner import Runner
from workers.settings import WorkerSettings
from workers.values import Batch, Entry, Ran, Results, Turn, by_stream

logger = logging.getLogger(__name__)

APART = 8
"""The most children running one suspect each at a time (:meth:`Isolation._apart`)."""


class Poisoned(ConveyorError):
    """An input that ended its model process (or whose call never returned) when run
    alone in a child: its entry is dead-lettered, its caller answered with this."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Died:
    """A child that ended without its answer: how (``was killed by SIGKILL``), and
    whether it was killed for running past its bound (``hung``)."""

    how: str
    hung: bool = False


class Isolation:
    """Runs one worker's suspects in children of its process (see above).

    Args:
        runner: the stage's model runner (its model, its turns, its call bounds).
        router: names the stage and its dead-letter stream.
        client: Redis client (the deliveries of an input dead-lettered).
        consumer: this worker's consumer name.
        settings: the worker's settings (``suspects_in_child``).
    """

    def __init__(
        self,
        runner: Runner,
        router: Router,
        client: aioredis.Redis,
        consumer: str,
        settings: WorkerSettings,
    ) -> None:
        self.runner, self.router, self.client = runner, router, client
        self.consumer, self.settings = consumer, settings
        self.children = 0  # forked so far (tests, introspection)

    @property
    def usable(self) -> bool:
        """Whether suspects run in a child: the setting on, ``os.fork`` there (Linux),
        the model loaded, not itemwise, not on an accelerator, CUDA not started."""
        model = self.runner.model
        if not self.settings.suspects_in_child or not sys.platform.startswith("linux"):
            return False
        if model is None or self.runner.is_a(ItemwiseModel) or self.runner.accelerated:
            return False
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        return not (cuda is not None and cuda.is_initialized())

    async def run(
        self, batch: Batch, turn: Turn, deadline: float, *, hung: bool = False
    ) -> Ran | None:
        """Run ``batch``'s live items in children (see above) and return what ran (None:
        nothing did); an input found to kill its process has its dead letter added to
        ``batch.letters`` and its caller's answer in its place among the results.

        Args:
            batch: the suspects' batch, opened by :meth:`workers.intake.Intake.open`.
            turn: the step's hooks: withdraws what was cancelled meanwhile.
            deadline: ``time.monotonic()`` of the batch's latest deadline.
            hung: the batch's model call hung (not crashed): each item runs in a child
                of its own at once (see :meth:`_apart`).
        """
        if not batch.live:
            return None
        # Unmarked: their marks still say "queued for a re-run", so a crash of the worker
        # while a child runs them (another input's doing) is not charged to them.
        async with self.runner.turn():
            emitter = await turn.at_turn(batch, mark=False)
        if emitter is not None:
            await emitter.close()  # a child streams nothing: its final answer says it all
        if not batch.live:
            return None
        items = [item for _, item in batch.live]
        logger.info(
            "stage %s: %d entr(ies) run in a child process (suspects of a crash, or "
            "within CONVEYOR_QUARANTINE_S of one)",
            self.router.stage,
            len(items),
        )
        started = time.perf_counter()
        results = await (self._apart(items, deadline) if hung else self._find(items, deadline))
        took = time.perf_counter() - started
        poisoned = [
            ((req.id, req.step), res)
            for (req, _), res in zip(batch.live, results, strict=True)
            if isinstance(res, Poisoned)
        ]
        if poisoned:
            await self._dead_letter(batch, poisoned)
        return Ran(items, results, took, cold=False, costed=False)

    async def _find(self, items: list[Item], deadline: float) -> Results:
        """``items``' results from a child; where it dies, from halves of them, each in
        a child of its own, down to the single input that kills (:class:`Poisoned`)."""
        got = await self._child(items, deadline)
        if not isinstance(got, Died):
            return got
        stage = self.router.stage
        if got.hung and time.monotonic() >= deadline:  # out of time: no half would run
            return [DeadlineExceeded("deadline passed while the step ran")] * len(items)
        if len(items) == 1:
            if got.hung:
                why = "its model call did not return within the stage's max_call_s"
                status = 504
            else:
                why = f"run alone, it ended its model process ({got.how})"
                status = 500
            message = f"{why}; dead-lettered: inspect with `conveyor dlq list {stage}`"
            return [Poisoned(message, status)]
        logger.warning(
            "stage %s: a child running %d suspects %s; running them again in halves",
            stage,
            len(items),
            got.how,
        )
        if got.hung:  # each level of halves would cost the whole bound again
            return await self._apart(items, deadline)
        mid = len(items) // 2
        first, second = await asyncio.gather(
            self._find(items[:mid], deadline), self._find(items[mid:], deadline)
        )
        return first + second

    async def _apart(self, items: list[Item], deadline: float) -> Results:
        """``items`` each in a child of its own, a few at a time (as many as the host has
        cores, at most :data:`APART`): after a hang, the input that hangs costs its bound
        once, alone, and the others answer at their own speed beside it, not after
        log2(n) levels of halves that each wait the bound out."""
        slots = asyncio.Semaphore(min(APART, os.cpu_count() or 1, len(items)))

        async def one(item: Item) -> Results:
            async with slots:
                return await self._find([item], deadline)

        found = await asyncio.gather(*(one(item) for item in items))
        return [result for results in found for result in results]

    async def _child(self, items: list[Item], deadline: float) -> Results | Died:
        """``items`` run in a child of this process: their results, or how it died."""
        model = self.runner.model
        assert model is not None
        watchdog = self.runner.watchdog
        left = min(max(deadline - time.monotonic(), 0.0) + watchdog.grace_s, watchdog.max_call_s)
        async with self.runner.turn():  # the model idle while the process forks
            pid, fd = fork_running(model, items, deadline)
        self.children += 1
        try:
            status, data = await wait_child(pid, fd, left)
        finally:
            os.close(fd)
        if status is None:
            return Died(f"ran past its bound ({left:.1f} s) and was killed", hung=True)
        if status != 0:
            return Died(ended(status))
        try:
            return decode_results(data, len(items))
        except ValueError as exc:  # an exit 0 without its answer: user code exited
            return Died(f"exited without its results ({exc})")

    async def _dead_letter(
        self, batch: Batch, poisoned: list[tuple[tuple[str, str], Poisoned]]
    ) -> None:
        """Add the dead letters of the ``poisoned`` requests' entries (by request id and
        step: one request may have two entries here, two branches of a fan-out) to
        ``batch``."""
        stage = self.router.stage
        by_request: dict[tuple[str, str], Entry] = {}
        for entry in batch.entries:
            who = sender(entry.fields)
            if who is not None:
                by_request.setdefault((who.id, who.step), entry)
        found = [(by_request[rid], exc) for rid, exc in poisoned if rid in by_request]
        counts: dict[bytes, int] = {}
        try:
            for stream, ids in by_stream(e for e, _ in found).items():
                counts.update(await deliveries(self.client, stream, self.consumer, ids))
        except REDIS_DOWN as exc:  # the letter says less; it is written with the batch
            logger.warning("stage %s: deliveries unread: %s", stage, exc)
        for entry, why in found:
            fields = letter(entry.id, entry.fields, counts.get(entry.id, 2), str(why))
            batch.letters.append((self.router.keys.dead_letters(stage), fields))
            logger.error("stage %s: entry %r dead-lettered: %s", stage, entry.id, why)
