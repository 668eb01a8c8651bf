"""Writes a gateway makes after the request that asked for them has been answered.

Withdrawing a refused request (:mod:`gateway.withdraw`) and marking a request whose client
left (:mod:`gateway.cancel`) both run as background tasks: each is kept (never left to the
garbage collector), the number at once is bounded, and a failure is logged, never lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from runtime.waiting import cancel_and_wait

logger = logging.getLogger(__name__)


class Background:
    """One kind of background write of one gateway process.

    Args:
        what: what the tasks do, for the log lines ("withdrawal", "cancellation").
        limit: tasks at once, at most; past it a new one is refused (logged).
    """

    def __init__(self, what: str, limit: int) -> None:
        self.what = what
        self.limit = limit
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, request_id: str, write: Coroutine[Any, Any, Any]) -> bool:
        """Run ``write`` for ``request_id`` in the background; False (logged, ``write``
        closed unrun) when :attr:`limit` tasks are pending already."""
        if len(self._tasks) >= self.limit:
            write.close()
            logger.warning("request %s: no %s, %d pending", request_id, self.what, len(self._tasks))
            return False
        task = asyncio.create_task(write, name=f"{self.what}-{request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return True

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # e.g. NOPERM from an ACL without the command: the request is not helped.
            logger.error("a %s failed", self.what, exc_info=task.exception())

    async def finish(self) -> None:
        """Wait for the pending tasks (each bounds its own time)."""
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def cancel(self) -> None:
        """Stop the pending tasks and wait for them to end."""
        await cancel_and_wait(list(self._tasks))
