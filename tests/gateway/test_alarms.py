"""Alarms (gateway/alarms.py): each fires at its own time on one timer, unless done by
then; those done are swept out, those still due are kept."""

from __future__ import annotations

import asyncio

from gateway.alarms import COMPACT_AT, Alarms


async def test_each_alarm_fires_at_its_own_time_unless_done() -> None:
    loop = asyncio.get_running_loop()
    alarms = Alarms()
    fired: list[tuple[str, float]] = []
    three = asyncio.Event()
    start = loop.time()
    due = {"late": 0.4, "first": 0.1, "second": 0.2, "moot": 0.3}

    def ring(name: str) -> None:
        fired.append((name, loop.time()))
        if len(fired) == 3:
            three.set()

    for name, after in due.items():
        alarms.at(
            loop,
            start + after,
            lambda n=name: n == "moot",  # type: ignore[misc]
            lambda n=name: ring(n),  # type: ignore[misc]
        )

    await asyncio.wait_for(three.wait(), 5)
    assert [n for n, _ in fired] == ["first", "second", "late"]  # in order; the done never
    assert all(at >= start + due[n] for n, at in fired)  # none before its time


async def test_a_waiter_fails_with_timeout_unless_answered() -> None:
    loop = asyncio.get_running_loop()
    alarms = Alarms()
    answered, waiting = loop.create_future(), loop.create_future()
    alarms.fail_at(loop, loop.time() + 0.05, answered)
    alarms.fail_at(loop, loop.time() + 0.05, waiting)
    answered.set_result(None)
    await asyncio.wait([waiting], timeout=5)
    assert isinstance(waiting.exception(), TimeoutError)
    assert answered.result() is None


async def test_done_alarms_behind_a_long_one_are_swept_and_the_rest_still_fire() -> None:
    loop = asyncio.get_running_loop()
    alarms = Alarms()
    long = loop.create_future()
    alarms.fail_at(loop, loop.time() + 60, long)  # at the top for the whole test
    done = []
    for _ in range(3 * COMPACT_AT):
        f = loop.create_future()
        alarms.fail_at(loop, loop.time() + 30, f)
        f.set_result(None)
        done.append(f)
    assert len(alarms._due) < 2 * COMPACT_AT  # swept, not held until the long one rings
    soon = loop.create_future()
    alarms.fail_at(loop, loop.time() + 0.05, soon)
    await asyncio.wait([soon], timeout=5)
    assert isinstance(soon.exception(), TimeoutError)
    assert not long.done()
    long.cancel()
