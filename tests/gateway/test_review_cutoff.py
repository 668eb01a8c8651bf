"""The body-read deadline (gateway/edge.py ``_receive_by``) against what it emulates,
``asyncio.timeout_at``: in each race of the deadline with the message, with another
cancellation and with the task going on past the deadline, both end alike (the outcome,
and the task's count of cancellations asked)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from starlette.types import Message

from gateway.alarms import Alarms
from gateway.edge import _receive_by

Scoped = Callable[[float, Callable[[], Awaitable[Message]]], Awaitable[Message]]
MESSAGE: Message = {"type": "http.request", "body": b"x", "more_body": False}


async def by_timeout(deadline: float, receive: Callable[[], Awaitable[Message]]) -> Message:
    async with asyncio.timeout_at(deadline):
        return await receive()


def by_alarms() -> Scoped:
    alarms = Alarms()

    async def scoped(deadline: float, receive: Callable[[], Awaitable[Message]]) -> Message:
        return await _receive_by(alarms, deadline, receive)

    return scoped


async def race(scoped: Scoped, case: str) -> tuple[str, int, bool]:
    """What a task reading with ``scoped`` in ``case`` sees: its outcome, its count of
    cancellations asked after the read, and whether it lived on past the deadline."""
    loop = asyncio.get_running_loop()
    now = loop.time()
    pending: asyncio.Future[Message] = loop.create_future()

    async def forever() -> Message:
        return await pending

    async def at_once() -> Message:
        return MESSAGE

    deadline, receive = now + 0.05, forever
    if case == "past":
        deadline = now - 1
    elif case == "answered":
        receive = at_once
    elif case == "message_and_deadline_together":
        loop.call_at(deadline, pending.set_result, MESSAGE)
    seen: list[Any] = []

    async def reader() -> None:
        try:
            got = await scoped(deadline, receive)
            outcome = "message" if got is MESSAGE else repr(got)
        except (TimeoutError, asyncio.CancelledError) as exc:  # recorded: the outcome
            outcome = type(exc).__name__
        seen.extend([outcome, asyncio.current_task().cancelling()])  # type: ignore[union-attr]
        await asyncio.sleep(max(0.0, deadline - loop.time()) + 0.1)  # past the deadline
        seen.append(True)

    task = asyncio.create_task(reader())
    await asyncio.sleep(0)
    if case == "cancelled":
        task.cancel()
    elif case == "cancelled_with_the_deadline":  # right after it, in the same iteration
        loop.call_at(deadline, task.cancel)
    await asyncio.wait_for(task, 5)
    return seen[0], seen[1], seen[2]


@pytest.mark.parametrize(
    "case",
    [
        "past",
        "late",
        "answered",
        "message_and_deadline_together",
        "cancelled",
        "cancelled_with_the_deadline",
    ],
)
async def test_the_alarm_deadline_ends_as_asyncio_timeout_at(case: str) -> None:
    expected = await race(by_timeout, case)
    got = await race(by_alarms(), case)
    assert got == expected
