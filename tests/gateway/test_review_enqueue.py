"""The enqueue wait's deadline on the shared alarm heap (gateway/enqueue.py): a caller
cancelled in the very iteration its deadline fails its wait leaves no outcome nobody
reads (asyncio's "exception was never retrieved" error line). Real Redis (stalled)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.enqueue import Enqueuer
from pipelines.keys import Keys
from tests.helpers import Harness


async def test_a_caller_cancelled_as_its_deadline_fires_leaves_no_unread_outcome(
    harness: Harness, own_redis: subprocess.Popen[bytes], namespace: str
) -> None:
    client = aioredis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])
    await client.ping()  # connected before Redis stalls: the XADD is sent, never answered
    enqueuer = Enqueuer(client, Keys(namespace), write_s=0.3)
    loop = asyncio.get_running_loop()
    unread: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unread.append(context))
    own_redis.send_signal(signal.SIGSTOP)
    try:
        caller = asyncio.create_task(
            enqueuer.enqueue(harness.request("p", "double", "double", {"value": 1}))
        )
        await asyncio.sleep(0)  # its wait armed
        ((when, *_),) = enqueuer._alarms._due

        # Cancelled right after its deadline fired, in the same iteration.
        def cancel() -> None:
            caller.cancel()

        enqueuer._alarms.at(loop, when, lambda: False, cancel)
        with pytest.raises(asyncio.CancelledError):
            await caller
    finally:
        own_redis.send_signal(signal.SIGCONT)
        for lead in list(enqueuer._leading):
            lead.cancel()
        await asyncio.gather(*enqueuer._leading, return_exceptions=True)
        await client.aclose()
        gc.collect()  # the wait's future, let go by its round trip too
        loop.set_exception_handler(None)
    assert not [c for c in unread if "never retrieved" in str(c.get("message"))]
