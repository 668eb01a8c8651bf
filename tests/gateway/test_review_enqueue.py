"""The enqueue wait's deadline on the shared alarm heap (gateway/enqueue.py): a caller
cancelled in the very iteration its deadline fails its wait leaves no outcome nobody
reads (asyncio's "exception was never retrieved" error line). Real Redis (stalled)."""

from __future__ import annotations

import asyncio
import gc
import subprocess
from typing import Any

import pytest

from tests.gateway.test_hot_path import stalled
from tests.helpers import Harness


async def test_a_caller_cancelled_as_its_deadline_fires_leaves_no_unread_outcome(
    harness: Harness, own_redis: subprocess.Popen[bytes], namespace: str
) -> None:
    loop = asyncio.get_running_loop()
    unread: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unread.append(context))
    try:
        async with stalled(own_redis, namespace, write_s=0.3) as enqueuer:
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
        gc.collect()  # the wait's future, let go by its round trip too
    finally:
        loop.set_exception_handler(None)
    assert not [c for c in unread if "never retrieved" in str(c.get("message"))]
