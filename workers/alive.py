"""The worker's liveness file: touched each time its read loop comes round.

A worker has no HTTP port; what a supervisor (Kubernetes, Docker) can see of it is a
file. The loop touches ``CONVEYOR_ALIVE_FILE`` after every read (at least every
``CONVEYOR_BLOCK_MS`` while idle) and whenever a batch frees a slot for the next read, so
a file older than the longest batch plus a margin means the loop has stopped coming
round: a model call that never returns, an event loop blocked, a deadlock. (A model
call past every deadline of its batch by ``CONVEYOR_HUNG_GRACE_S`` ends the worker
itself: :func:`workers.runner.hung`.) The probe
is a shell one-liner (no Python start per probe)::

    test $(( $(date +%s) - $(stat -c %Y "$CONVEYOR_ALIVE_FILE") )) -lt 120

The file first appears once the model is loaded and the loop reads, so a start-up probe
with a generous budget covers the load and the liveness probe takes over after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pipelines.keys import Keys
from runtime.redisio import REDIS_DOWN, RedisClock
from runtime.status import beat_until
from runtime.waiting import cancel_and_wait

logger = logging.getLogger(__name__)

INTERVAL_S = 1.0
"""Touch at most this often (a touch is a syscall; the loop comes round far more)."""

STOP_WAIT_S = 5.0
"""How long :meth:`Presence.stop` waits for a beat in flight before cancelling it."""


class AliveFile:
    """Touches ``path`` (when set) at most every :data:`INTERVAL_S`.

    Args:
        path: the file (its folder must exist and be writable); None: do nothing.
    """

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self._last = float("-inf")

    def beat(self) -> None:
        """The loop came round: refresh the file's modification time."""
        if self.path is None:
            return
        now = time.monotonic()
        if now - self._last < INTERVAL_S:
            return
        self._last = now
        try:
            self.path.touch()  # sets the modification time of one that exists
        except OSError as exc:  # a full or read-only disk must not stop the work
            logger.warning("could not touch the liveness file %s: %s", self.path, exc)


class Presence:
    """The worker's heartbeat in Redis: what every status view counts as a live worker.

    Redis's own idle time of a consumer (XINFO CONSUMERS) cannot say it: on Redis 7.0 it
    counts from the last entry delivered, so a healthy worker with nothing to do looks
    gone after any quiet spell. So each worker says it itself: every third of
    ``stale_s`` a task sets its field of the stage's hash (:meth:`Keys.alive`) to when
    the beat runs out, on the Redis clock. A worker paused (SIGSTOP), killed, or whose
    event loop is blocked stops beating and counts as gone once its beat runs out; one
    idle for hours keeps beating. On its way it deletes the fields that ran out or are
    not a time (a crashed worker's, or forged ones), and an orderly stop deletes its own.

    A worker whose model runs torch on the CPU (:attr:`cpu_model`) beats in
    :meth:`Keys.cpu_models` too: what a worker started by hand on the same host divides
    the cores among (:mod:`workers.threads`).

    Args:
        client: Redis client.
        keys: key names (the field is kept in partition 0).
        stage: the stage.
        consumer: this worker's consumer name (the field).
        clock: the Redis clock (calibrated).
        stale_s: how long a beat counts.

    Attributes:
        cpu_model: its model runs torch's threads on the CPU (set once it is loaded).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        stage: str,
        consumer: str,
        clock: RedisClock,
        stale_s: float,
    ) -> None:
        self.client, self.key, self.consumer = client, keys.alive(stage), consumer
        self.place = keys.places(stage)  # where it runs (workers.places), also left
        self.cpu_models, self.cpu_model = keys.cpu_models(), False
        self.clock, self.stale_s = clock, stale_s
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def beat(self) -> None:
        """Set this worker's beat, and delete the fields that ran out."""
        now_ms = int(self.clock.now() * 1000)
        until = str(now_ms + int(self.stale_s * 1000))
        await self._beat_in(self.key, until, now_ms)
        if self.cpu_model:
            try:
                await self._beat_in(self.cpu_models, until, now_ms)
            except ResponseError as exc:  # the key forged to another type
                logger.warning("could not beat in %s: %s", self.cpu_models, exc)

    async def _beat_in(self, key: str, until: str, now_ms: int) -> None:
        """Set this worker's field of the hash of beats ``key`` to ``until``, and delete
        the fields that ran out by ``now_ms``."""
        await self.client.hset(key, self.consumer, until)
        beats = await self.client.hgetall(key)
        gone = [name for name, raw in beats.items() if (beat_until(raw) or 0) <= now_ms]
        if gone:
            await self.client.hdel(key, *gone)

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.beat()
            except REDIS_DOWN as exc:  # the next beat tries again; the work goes on
                logger.warning("could not beat in %s: %s", self.key, exc)
            except ResponseError as exc:  # the key forged to another type
                logger.warning("could not beat in %s: %s", self.key, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.stale_s / 3)

    def start(self) -> None:
        """Beat now and every third of the stale window until :meth:`stop`."""
        if self._task is None:
            self._stopping.clear()
            self._task = asyncio.create_task(self._run())

    async def stop(self, *, leave: bool) -> None:
        """Stop beating; ``leave``: also delete this worker's field (an orderly stop,
        so it counts as gone at once) and its place (:mod:`workers.places`).

        The beat is asked to end, not cancelled: a cancel landing inside a Redis command
        can be dropped (:func:`~runtime.waiting.cancel_and_wait`), and the task then beats
        on with nobody to stop it (a worker run in bursts hung here). One that does not end
        within :data:`STOP_WAIT_S` (a Redis that does not answer) is cancelled until it ends.
        """
        task, self._task = self._task, None
        if task is not None:
            self._stopping.set()
            done, _ = await asyncio.wait({task}, timeout=STOP_WAIT_S)
            if not done:
                await cancel_and_wait([task])
        if not leave:
            return
        keys = [self.key, self.place] + ([self.cpu_models] if self.cpu_model else [])
        for key in keys:
            try:
                await self.client.hdel(key, self.consumer)
            except ResponseError as exc:  # this key forged to another type: the others still
                logger.warning("could not remove the beat in %s: %s", key, exc)
            except REDIS_DOWN as exc:  # the beats run out by themselves
                logger.warning("could not remove the beat in %s: %s", key, exc)
                return
