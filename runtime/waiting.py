"""How a process waits: between tries of what cannot be done yet (:class:`Backoff`), and
for the tasks it cancels to end (:func:`cancel_and_wait`). Plain asyncio: what waits for
Redis in particular is :func:`runtime.redisio.until_reachable`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any


class Backoff:
    """The waits of a server process between tries of what Redis must answer while it
    cannot (:data:`~runtime.redisio.REDIS_DOWN`): short at first, doubling to a bound,
    and short again after a success. A server waits Redis out rather than exiting: it may
    start before Redis does (compose, Kubernetes), and Redis restarts.

    Args:
        first_s: the first wait.
        most_s: the longest wait.
    """

    def __init__(self, first_s: float = 0.1, most_s: float = 5.0) -> None:
        self.first_s, self.most_s = first_s, most_s
        self.next_s = first_s  # the wait :meth:`wait` sleeps next

    def reset(self) -> None:
        """Redis answered: the next wait is short again."""
        self.next_s = self.first_s

    async def wait(self, stop: asyncio.Event | None = None) -> None:
        """Sleep the next wait, or until ``stop`` is set; the one after is twice as long.

        Args:
            stop: ends the wait early (a process asked to stop does not sleep on).
        """
        wait, self.next_s = self.next_s, min(self.next_s * 2, self.most_s)
        if stop is None:
            await asyncio.sleep(wait)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), wait)


CANCEL_AGAIN_S = 0.2
"""How long :func:`cancel_and_wait` lets a cancelled task end before it cancels it again."""


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended.

    On Python 3.11, ``asyncio.wait_for`` (which redis-py puts around each command's send
    when a socket timeout is set, as ours is) drops a cancel that lands as the send
    finishes: the task reads the reply and goes on, maybe to another command, on a client
    that its owner closes meanwhile (a fresh connection, which nothing closes). A task
    still running :data:`CANCEL_AGAIN_S` after its cancel is cancelled again.
    """
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=CANCEL_AGAIN_S)
