"""The runner of function stages: a plain Python function called per item, concurrently."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel

from pipelines.errors import DeadlineExceeded
from pipelines.model import Item, Result, time_left


class FunctionRunner:
    """Runs a function stage: ``fn(item)`` for every item of a batch, concurrently.

    Sync functions run on a thread pool, async ones on an event loop owned by the model
    thread; at most ``concurrency`` at a time either way. An item whose call raises
    anything (``SystemExit`` and ``CancelledError`` too) gets it in its place, so it
    fails alone. An async call still running at the batch's deadline
    (:func:`~pipelines.model.time_left`) is cancelled there and its item expires
    (:class:`~pipelines.errors.DeadlineExceeded`), so a call that awaits forever frees
    the model thread for the next batch; a sync call cannot be stopped (the worker
    reports it hung past a grace: :func:`workers.runner.hung`).

    Args:
        fn: ``fn(dict) -> dict`` (or a pydantic model), sync or async.
        concurrency: calls in flight at once.
        setup: called once, first (see :func:`pipelines.graph.function`).
        options: the common runner arguments, unused.
    """

    def __init__(
        self,
        *,
        fn: Callable[[Item], Any],
        concurrency: int = 16,
        setup: Callable[[], object] | None = None,
        **options: Any,
    ) -> None:
        del options
        if setup is not None:
            setup()  # before serving: a failure stops the worker at start
        self.fn = fn
        self.concurrency = concurrency
        self.is_async = inspect.iscoroutinefunction(fn)
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="fn")
        self._loop = asyncio.new_event_loop() if self.is_async else None

    def predict(self, items: list[Item]) -> list[Result | BaseException]:
        """Call the function on each item; failures are returned in place."""
        if self._loop is not None:
            left = time_left()  # the batch's, set in this (the model) thread
            return self._loop.run_until_complete(self._gather(items, left))
        futures = [self._pool.submit(self._call_sync, item) for item in items]
        return [f.result() for f in futures]

    def _call_sync(self, item: Item) -> Result | BaseException:
        try:
            return _as_dict(self.fn(item))
        except BaseException as exc:  # the user's: in a pool thread none is the worker's
            return exc

    async def _gather(self, items: list[Item], left: float) -> list[Result | BaseException]:
        gate = asyncio.Semaphore(self.concurrency)
        loop = asyncio.get_running_loop()
        at = loop.time() + left if math.isfinite(left) else None

        async def one(item: Item) -> Result | BaseException:
            window = asyncio.timeout_at(at)
            try:
                async with window, gate:
                    return _as_dict(await self.fn(item))
            except BaseException as exc:
                # Nothing but the window cancels a call on this loop: whatever else
                # comes out (a CancelledError or SystemExit of its own) is the item's.
                if window.expired():
                    return DeadlineExceeded("the step ran past its deadline; cancelled")
                return exc

        return list(await asyncio.gather(*(one(item) for item in items)))


def _as_dict(value: Any) -> Result:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    result: Result = value  # checked to be a JSON object by the worker
    return result
