"""The runner of function stages: a plain Python function called per item, concurrently."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel

from pipelines.model import Item, Result


class FunctionRunner:
    """Runs a function stage: ``fn(item)`` for every item of a batch, concurrently.

    Sync functions run on a thread pool, async ones on an event loop owned by the model
    thread; at most ``concurrency`` at a time either way. An item whose call raises
    gets its exception in its place, so it fails alone.

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
            return self._loop.run_until_complete(self._gather(items))
        futures = [self._pool.submit(self._call_sync, item) for item in items]
        return [f.result() for f in futures]

    def _call_sync(self, item: Item) -> Result | BaseException:
        try:
            return _as_dict(self.fn(item))
        except Exception as exc:
            return exc

    async def _gather(self, items: list[Item]) -> list[Result | BaseException]:
        gate = asyncio.Semaphore(self.concurrency)

        async def one(item: Item) -> Result | BaseException:
            async with gate:
                try:
                    return _as_dict(await self.fn(item))
                except Exception as exc:
                    return exc

        return list(await asyncio.gather(*(one(item) for item in items)))


def _as_dict(value: Any) -> Result:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    result: Result = value  # checked to be a JSON object by the worker
    return result
