"""The share of a stage that requests of many items (an OpenAI list of texts, ``n``
choices) may hold: together, at most a window of items of this process's such requests
are in a stage at a time, so that they never take the backlog every other client is
admitted against.

A request's items are enqueued in parts: as many as the window has free at once, then
one more as a slot comes free, each request waiting its turn for a slot (first come,
first served, one turn at a time per request: two big requests share the window), all
within the request's one deadline. A part refused as overload while others of the
request are still in the stage waits for one of them to end and is tried again: a big
request yields room to the others instead of failing.

It costs no Redis command of its own: each item is still one XADD, the parts sent in
more round trips (one per wave of replies) instead of one. A request spread over more
time sees admission refresh its view of the stage more often (one measurement per
``admission_refresh_ms`` at most, shared with every other request to the stage).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pipelines.errors import DeadlineExceeded, Overloaded
from runtime.waiting import cancel_and_wait

T = TypeVar("T")


def window_of(bound: int, share: float) -> int:
    """How many items of requests of many items may be in a stage at a time.

    Args:
        bound: the stage's backlog bound.
        share: the fraction of it they may hold (``CONVEYOR_REQUEST_SHARE``).
    """
    return max(1, math.floor(bound * share))


class Shares:
    """This process's windows, one per stage (see the module doc).

    Args:
        share: the fraction of a stage's backlog bound they hold.
    """

    def __init__(self, share: float) -> None:
        self.share = share
        self._slots: dict[str, asyncio.Semaphore] = {}

    def slots(self, stage: str, bound: int) -> asyncio.Semaphore:
        """The window of ``stage``, whose backlog bound is ``bound``: one slot an item."""
        slots = self._slots.get(stage)
        if slots is None:
            slots = self._slots[stage] = asyncio.Semaphore(window_of(bound, self.share))
        return slots


async def in_parts(
    run: Callable[[int, float], Coroutine[Any, Any, T]],
    count: int,
    slots: asyncio.Semaphore,
    budget_s: float,
) -> list[T]:
    """Run items ``0 .. count-1`` with ``run(i, left_s)``, each holding one of ``slots``
    while it runs (see the module doc), and return their results in order.

    Args:
        run: runs item ``i`` given ``left_s``, what is left of the request's budget.
        count: how many items.
        slots: the stage's window (:meth:`Shares.slots`).
        budget_s: the whole request's time budget, from now.

    Raises:
        BaseException: the first failure by index, once the parts in flight ended; no part
            starts after a failure (the request is answered with it: the rest would run
            for nobody). A part whose turn comes past the budget is
            :class:`~pipelines.errors.DeadlineExceeded`.
    """
    loop = asyncio.get_running_loop()
    give_up = loop.time() + budget_s
    results: dict[int, T] = {}
    failures: dict[int, BaseException] = {}
    waiting = deque(range(count))
    running: dict[asyncio.Task[T], int] = {}
    turn: asyncio.Task[bool] | None = None  # this request's place in line for a slot
    limit = count  # lowered to what is in flight when the stage refuses a part

    def start() -> None:  # a slot is held: the next item takes it
        i = waiting.popleft()
        left_s = give_up - loop.time()
        if left_s <= 0:
            slots.release()
            failures[i] = DeadlineExceeded(f"no result within {budget_s:g}s")
        else:
            running[asyncio.create_task(run(i, left_s))] = i

    def more() -> bool:
        return bool(waiting) and not failures and len(running) < limit

    try:
        while running or more():
            # Free slots are taken at once (awaiting a free one does not yield), so the
            # parts of one moment go in one round trip; then one turn in line at a time.
            while turn is None and more() and not slots.locked():
                await slots.acquire()
                start()
            if turn is None and more():
                turn = asyncio.create_task(slots.acquire())
            watched: set[asyncio.Task[Any]] = {*running, *([turn] if turn else [])}
            if not watched:
                break
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            ended = [(task, running.pop(task)) for task in done if task in running]
            room = bool(running) or any(_failure(t) is None for t, _ in ended)
            for task, i in ended:
                slots.release()
                exc = _failure(task)
                if exc is None:
                    results[i] = task.result()
                    limit = min(count, limit + 1)  # room came back: probe for more
                elif isinstance(exc, Overloaded) and room and not failures:
                    # Full, partly with this request's own items: tried again once one
                    # of them ends, and no more in flight than now meanwhile.
                    waiting.appendleft(i)
                    limit = max(1, len(running))
                else:
                    failures[i] = exc
            if turn is not None and turn in done:
                turn = None
                if more():
                    start()
                else:  # a part failed, or the stage refused one, since it got in line
                    slots.release()
    finally:
        # A request cancelled midway (or failed): its parts stop, its place in line too.
        await cancel_and_wait([*running, *([turn] if turn else [])])
        for _ in running:
            slots.release()
        if turn is not None and not turn.cancelled() and turn.exception() is None:
            slots.release()  # the slot came just as the request ended
    if failures:
        raise failures[min(failures)]
    return [results[i] for i in range(count)]


def _failure(task: asyncio.Task[T]) -> BaseException | None:
    """What ``task`` (ended) failed with, a cancel included; None: it succeeded."""
    return asyncio.CancelledError() if task.cancelled() else task.exception()
