"""The runner of function stages: a plain Python function called per item, each call on
its own, beside the others."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel

from pipelines.errors import DeadlineExceeded
from pipelines.model import Item, Result, time_left

Call = Future[Result | BaseException]
"""One call's future: its result, or what it raised, as a value; done when the call ends."""

CLOSE_S = 5.0
"""How long :meth:`FunctionRunner.close` waits for the async calls it cancels to end."""


class FunctionRunner:
    """Runs a function stage: ``fn(item)`` for each item, a call of its own
    (:class:`~pipelines.model.ItemwiseModel`): the worker submits each item as it comes
    (:meth:`submit`) and answers it when its call ends, so one slow call holds only its
    own item, never the stage.

    Sync functions run on a thread pool of ``concurrency`` threads; async ones on an
    event loop this runner owns, in a thread of its own, at most ``concurrency`` at a
    time. A call that raises anything (``SystemExit`` and ``CancelledError`` too) has it
    in its item's place, so it fails alone. An async call still running at its deadline
    is cancelled there and its item expires (:class:`~pipelines.errors.DeadlineExceeded`);
    a sync call cannot be stopped: the worker answers its item at the deadline and drops
    its result, and a call still running a grace later ends the worker as hung
    (:func:`workers.modelthread.hung`), since its thread is lost for good.

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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # The async calls running, by their futures: read and written on the loop alone.
        self._tasks: dict[Call, asyncio.Task[Result | BaseException]] = {}
        if self.is_async:
            self._loop = asyncio.new_event_loop()
            self._gate = asyncio.Semaphore(concurrency)  # used on that loop alone
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="fn-loop", daemon=True
            )
            self._thread.start()

    def submit(self, item: Item, deadline: float) -> Call:
        """Start ``fn(item)`` and return its future at once (see
        :meth:`~pipelines.model.ItemwiseModel.submit`): it ends when the call does.

        Args:
            item: one request's input.
            deadline: ``time.monotonic()`` at which an async call is cancelled.
        """
        loop = self._loop
        if loop is None:
            return self._pool.submit(self._call_sync, item)
        call: Call = Future()
        call.set_running_or_notify_cancel()  # a cancel of the future alone stops nothing
        loop.call_soon_threadsafe(self._start, call, item, deadline)
        return call

    def cancel(self, call: Call) -> None:
        """Ask ``call`` to stop: an async call is cancelled (its item gets the
        ``CancelledError``, or expires if its deadline came first); a sync call not yet
        started never starts, one running runs on."""
        if self._loop is None:
            call.cancel()
        else:
            with contextlib.suppress(RuntimeError):  # closed: nothing runs there
                self._loop.call_soon_threadsafe(self._stop, call)

    def predict(self, items: list[Item]) -> list[Result | BaseException]:
        """Call the function on each item, concurrently, and wait for them all; failures
        are returned in place. Async calls end at the batch's deadline (set in the
        calling thread, :func:`~pipelines.model.time_left`)."""
        deadline = time.monotonic() + time_left()
        futures = [self.submit(item, deadline) for item in items]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Cancel the async calls still running and end their loop's thread; let the
        pool's threads go (a sync call still running finishes on its own). Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            ended = asyncio.run_coroutine_threadsafe(_cancel_all(), loop)
            with contextlib.suppress(TimeoutError):
                ended.result(CLOSE_S)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(CLOSE_S)
            if not thread.is_alive():
                loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _start(self, call: Call, item: Item, deadline: float) -> None:
        """On the loop: run the call as a task, its end setting ``call``."""
        task = asyncio.create_task(self._call_async(item, deadline))
        self._tasks[call] = task

        def ended(task: asyncio.Task[Result | BaseException]) -> None:
            del self._tasks[call]
            call.set_result(asyncio.CancelledError() if task.cancelled() else task.result())

        task.add_done_callback(ended)

    def _stop(self, call: Call) -> None:
        """On the loop: cancel ``call``'s task, if it still runs."""
        task = self._tasks.get(call)
        if task is not None:
            task.cancel()

    def _call_sync(self, item: Item) -> Result | BaseException:
        try:
            return _as_dict(self.fn(item))
        except BaseException as exc:  # the user's: in a pool thread none is the worker's
            return exc

    async def _call_async(self, item: Item, deadline: float) -> Result | BaseException:
        left = deadline - time.monotonic()
        at = asyncio.get_running_loop().time() + left if math.isfinite(left) else None
        window = asyncio.timeout_at(at)
        try:
            async with window, self._gate:
                return _as_dict(await self.fn(item))
        except BaseException as exc:
            # A CancelledError or SystemExit of the call's own is its item's; so is the
            # cancel of a caller that gave up on it (:meth:`cancel`).
            if window.expired():
                return DeadlineExceeded("the step ran past its deadline; cancelled")
            return exc


async def _cancel_all() -> None:
    """Cancel every other task of the running loop and wait (a while) for them to end."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=CLOSE_S)


def _as_dict(value: Any) -> Result:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    result: Result = value  # checked to be a JSON object by the worker
    return result
