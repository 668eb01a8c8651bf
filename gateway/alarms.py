"""Deadlines by the thousand on one loop timer (:class:`Alarms`): what the gateway arms for
each request, nearly always for nothing, costs a heap push instead of a timer of its own."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable

COMPACT_AT = 1024
"""The least heap size at which alarms that are done are swept out of it."""


class Alarms:
    """Calls each ``fire`` at its own time, unless its ``done`` says it is moot by then,
    on one loop timer.

    The timer is armed for the earliest time; when it rings, every alarm due by then is
    fired (or dropped, done), and it is armed again for the next. A deadline that nearly
    always passes unused (a write's, a body's) so costs no timer armed and cancelled of
    its own (``asyncio.timeout``'s cost, several times this one's); each fires at its own
    time all the same. An alarm done is dropped from the heap as it comes to the top, and
    all of them whenever the heap has doubled (one long deadline at the top holds back
    those behind it).
    """

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Callable[[], bool], Callable[[], None]]] = []  # heap
        self._seq = itertools.count()  # ties: in order, never comparing the callables
        self._timer: asyncio.TimerHandle | None = None
        self._at = math.inf  # when the timer rings
        self._loop: asyncio.AbstractEventLoop | None = None
        self._limit = COMPACT_AT  # the heap's size that has the done swept out

    def at(
        self,
        loop: asyncio.AbstractEventLoop,
        when: float,
        done: Callable[[], bool],
        fire: Callable[[], None],
    ) -> None:
        """Call ``fire`` at ``when`` (``loop``'s time) unless ``done()`` is true by then.

        Args:
            loop: the running loop.
            when: the deadline (past already: at the loop's next iteration).
            done: whether the alarm is moot (what it guards has ended).
            fire: what to do at ``when``, run by the loop.
        """
        if loop is not self._loop:  # a loop of its own (tests): what the old one held is moot
            self._due, self._timer, self._at, self._loop = [], None, math.inf, loop
        due = self._due
        while due and due[0][2]():  # done: dropped, so the heap stays small
            heapq.heappop(due)
        if len(due) >= self._limit:  # one long wait at the top holds the done behind it
            due[:] = [alarm for alarm in due if not alarm[2]()]
            heapq.heapify(due)
            self._limit = max(COMPACT_AT, 2 * len(due))  # amortized: a constant per alarm
        heapq.heappush(due, (when, next(self._seq), done, fire))
        if when < self._at:
            self._arm(loop, when)

    def fail_at(
        self, loop: asyncio.AbstractEventLoop, when: float, waiter: asyncio.Future[None]
    ) -> None:
        """Fail ``waiter`` with ``TimeoutError`` at ``when``, unless it is done by then."""
        self.at(loop, when, waiter.done, lambda: waiter.set_exception(TimeoutError()))

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at = when
        self._timer = loop.call_at(when, self._ring, loop, when)

    def _ring(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        self._timer, self._at = None, math.inf
        due = self._due
        while due and (due[0][0] <= at or due[0][2]()):
            _, _, done, fire = heapq.heappop(due)
            if not done():
                fire()
        if due:
            self._arm(loop, due[0][0])
