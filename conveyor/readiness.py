"""When ``conveyor up`` is ready: every stage has a worker of its own that reads.

The gateway answers ``/readyz`` as soon as it reaches Redis, while the workers may still be
loading their models (seconds, on a busy machine tens of them): a first request sent then
waits, and may run out its deadline. ``up`` therefore says when it is really ready. A
worker joins its stage's consumer group with its first read, which it makes only once its
model has loaded, so a stage is ready when a consumer of one of ``up``'s own worker
processes is in its group (consumer names hold the process id; a consumer left by an
earlier run, in a Redis that outlived it, does not count).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Collection

from pipelines.redisio import REDIS_DOWN, connect
from pipelines.settings import CommonSettings
from pipelines.stats import stage_status

POLL_S = 0.25
"""How often the stages are looked at until they are ready."""


def ours(consumer: str, pids: Collection[int]) -> bool:
    """Whether ``consumer`` (named host-pid-random) belongs to one of ``pids``."""
    parts = consumer.rsplit("-", 2)
    return len(parts) == 3 and parts[1].isdigit() and int(parts[1]) in pids


async def waiting(
    settings: CommonSettings, stages: Collection[str], pids: Collection[int]
) -> list[str]:
    """The ``stages`` that no consumer of ``pids`` reads yet."""
    client = connect(settings)
    try:
        left = []
        for stage in stages:
            status = await stage_status(client, settings.keys, stage)
            if not any(c.alive and ours(c.name, pids) for c in status.consumers):
                left.append(stage)
        return left
    finally:
        await client.aclose()


class Readiness(threading.Thread):
    """Prints one line once every stage is read by one of ``up``'s workers.

    Args:
        settings: where Redis is.
        stages: the stages served.
        pids: the process ids of ``up``'s workers now (asked at every look: the
            autoscaler starts its own).
        say: prints a line.
    """

    def __init__(
        self,
        settings: CommonSettings,
        stages: Collection[str],
        pids: Callable[[], Collection[int]],
        say: Callable[[str], None],
    ) -> None:
        super().__init__(name="conveyor-readiness", daemon=True)
        self.settings, self.stages, self.pids, self.say = settings, stages, pids, say
        self.started_at = time.monotonic()
        self.ready = threading.Event()
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                left = asyncio.run(waiting(self.settings, self.stages, self.pids()))
            except REDIS_DOWN:
                left = list(self.stages)  # Redis is starting, or gone (``up`` says so)
            if not left:
                took = time.monotonic() - self.started_at
                self.say(f"ready: every stage's workers have loaded their models ({took:.1f}s)")
                self.ready.set()
                return
            self.stopped.wait(POLL_S)

    def stop(self) -> None:
        """Stop looking (``up`` is stopping)."""
        self.stopped.set()
