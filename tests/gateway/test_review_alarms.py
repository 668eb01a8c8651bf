"""The gateway's shared alarm heap (gateway/alarms.py) in its uses: a call that is over
leaves nothing of its own held by the heap (its reply, its future), however long its
deadline and whatever earlier deadline still waits above it. Real Redis, real HTTP."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

from gateway.service import Gateway
from tests.helpers import Doubler, Harness, number_stage, until

PLAIN = {"Content-Type": "application/json"}


async def test_an_answered_call_is_not_held_by_the_heap_behind_an_earlier_deadline(
    harness: Harness,
) -> None:
    served, idle = number_stage("double", batch_wait_ms=0), number_stage("idle")
    worker = harness.worker(served, Doubler())
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([served, idle])
    gw: Gateway = http._transport.app.state.gateway  # type: ignore[attr-defined]
    futures: list[weakref.ref[asyncio.Future[Any]]] = []
    expect = gw.replies.expect

    def expect_noted(request_id: str) -> asyncio.Future[Any]:
        future = expect(request_id)
        futures.append(weakref.ref(future))
        return future

    gw.replies.expect = expect_noted  # type: ignore[method-assign]
    # A call nobody serves waits with a short deadline, at the top of the heap.
    pending = asyncio.create_task(
        http.post(
            "/v1/idle", content=b'{"value": 1}', headers={**PLAIN, "X-Conveyor-Timeout": "30"}
        )
    )
    try:

        async def armed() -> bool:  # the idle call's deadline is in the heap
            return len(gw.alarms._due) == 1

        await until(armed, limit_s=10)
        answered = await http.post(
            "/v1/double", content=b'{"value": 2}', headers={**PLAIN, "X-Conveyor-Timeout": "200"}
        )
        assert answered.status_code == 200
        assert not pending.done()
        del answered
        gc.collect()
        # The answered call's future (and the reply it holds) is free once the call is over.
        assert futures[1]() is None
    finally:
        pending.cancel()


async def test_mixed_deadlines_each_end_at_their_own_time(harness: Harness) -> None:
    # A long deadline armed first (the heap's top until shorter ones come), then shorter
    # ones out of order: each call gets its 504 at its own deadline, none before.
    served, idle = number_stage("double", batch_wait_ms=0), number_stage("idle")
    worker = harness.worker(served, Doubler())
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([served, idle])
    loop = asyncio.get_running_loop()
    ended: dict[str, float] = {}

    async def call(stage: str, budget: str) -> int:
        started = loop.time()
        headers = {**PLAIN, "X-Conveyor-Timeout": budget}
        resp = await http.post(f"/v1/{stage}", content=b'{"value": 1}', headers=headers)
        ended[budget] = loop.time() - started
        return resp.status_code

    timeouts = ["2.5", "0.9", "0.3", "1.5", "0.6"]
    waiting = [asyncio.create_task(call("idle", t)) for t in timeouts]
    # Answered calls with long deadlines come and go meanwhile.
    assert [await call("double", "100") for _ in range(5)] == [200] * 5
    assert await asyncio.gather(*waiting) == [504] * len(timeouts)
    assert all(ended[t] >= float(t) for t in timeouts)  # none before its deadline
    assert sorted(timeouts, key=lambda t: ended[t]) == sorted(timeouts, key=float)
