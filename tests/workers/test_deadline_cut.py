"""A long model call ends early once every request of its batch is past its deadline
(:func:`pipelines.model.check_deadline`), so a shared model thread is not held for
answers nobody waits for (issue 23, break 4: one summarize request held the thread
shared with embed and sentiment for 40 s after its client got its 504)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from pipelines.envelope import decode_replies
from pipelines.errors import DeadlineExceeded
from pipelines.model import Item, Result, batch_deadline, check_deadline
from tests.helpers import Harness, number_stage, until
from workers.contract import run_isolating


class Steps:
    """Works ``value`` steps of 10 ms per item, checking the deadline between steps."""

    def __init__(self, **options: Any) -> None:
        self.steps = 0
        self.calls = 0

    def predict(self, items: list[Item]) -> list[Result]:
        """Step, then answer each value."""
        self.calls += 1
        for _ in range(max(item["value"] for item in items)):
            check_deadline()
            time.sleep(0.01)
            self.steps += 1
        return [{"value": item["value"]} for item in items]


def test_a_batch_out_of_time_is_not_split_to_find_a_culprit() -> None:
    model = Steps()
    with batch_deadline(time.monotonic() - 1):  # already past
        results = run_isolating(model, [{"value": 5} for _ in range(8)])
    assert model.calls == 1  # not log2(8) more calls, each failing the same way
    assert all(isinstance(r, DeadlineExceeded) for r in results)


def test_outside_a_batch_there_is_no_deadline() -> None:
    check_deadline()  # raises nothing


@pytest.mark.timeout(60)
async def test_a_long_call_stops_at_its_deadline_and_the_model_serves_the_next(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage("steps", batch_wait_ms=0)
    model = Steps()
    harness.run(harness.worker(stage, model))
    reply_to = harness.keys.reply_stream("steps")
    # 3,000 steps: 30 s of model time, for a client that waits 1 s.
    [long] = await harness.enqueue("steps", [{"value": 3000}], deadline_in=1, reply_to=reply_to)

    async def replies() -> dict[str, Any]:
        return {
            r.id: r
            for r in (
                one
                for _, f in await redis.xrange(reply_to) or []
                for one in decode_replies(f or {})
            )
        }

    async def answered_long() -> bool:
        return long.id in await replies()

    await until(answered_long, 30)
    assert (await replies())[long.id].outcome == "expired"
    assert model.steps < 3000  # it stopped, not ran to the end
    [short] = await harness.enqueue("steps", [{"value": 1}], reply_to=reply_to)

    async def answered_short() -> bool:
        return short.id in await replies()

    await until(answered_short, 30)
    assert (await replies())[short.id].result == {"value": 1}
