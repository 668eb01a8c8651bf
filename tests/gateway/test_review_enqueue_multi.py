"""Review of the enqueue burst as one MULTI/EXEC (gateway/enqueue.py): what a refused or
busy Redis leaves behind on the pooled connection (per-request isolation: test_hot_path)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from gateway.enqueue import Enqueuer
from pipelines.keys import Keys
from pipelines.settings import CommonSettings
from runtime.redisio import REFUSED, connect
from tests.helpers import Harness, until

# Runs on the server for about ``ms`` milliseconds (a long script: Redis answers BUSY to
# other clients once it passes busy-reply-threshold).
SPIN = """
local start = redis.call('TIME')
while true do
  local now = redis.call('TIME')
  if (now[1] - start[1]) * 1000000 + (now[2] - start[2]) > tonumber(ARGV[1]) * 1000 then
    return 1
  end
end
"""


async def test_a_burst_refused_busy_leaves_no_connection_inside_a_transaction(
    own_redis: subprocess.Popen[bytes], harness: Harness, namespace: str
) -> None:
    # While a script runs past busy-reply-threshold, Redis accepts MULTI (allow_busy)
    # but answers BUSY to each XADD and to EXEC (EXEC is not allow_busy): the server
    # keeps that connection in MULTI. redis-py releases it to the pool as it is (no
    # DISCARD), so the next command on it is QUEUED rather than run.
    keys = Keys(namespace)
    client = connect(CommonSettings(), connections=1)  # one connection: it is reused
    spinner = aioredis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])
    try:
        await client.config_set("busy-reply-threshold", 50)
        spinning = asyncio.ensure_future(spinner.eval(SPIN, 0, 1500))

        async def busy() -> bool:
            probe = aioredis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])
            try:
                await probe.ping()
                return False
            except ResponseError as exc:
                return "BUSY" in str(exc)
            finally:
                await probe.aclose()

        await until(busy, 10)
        enqueuer = Enqueuer(client, keys, write_s=10)
        burst = [harness.request("p", "double", "double", {"value": i}) for i in range(4)]
        outcomes = await asyncio.gather(
            *(enqueuer.enqueue(r) for r in burst), return_exceptions=True
        )
        assert all(isinstance(o, REFUSED) for o in outcomes), outcomes  # BUSY: refused
        assert await asyncio.wait_for(spinning, 10) == 1  # the script is over
        # Redis is free again: the next burst, and a lone request, go in.
        again = [harness.request("p", "double", "double", {"value": i}) for i in range(4)]
        got = await asyncio.gather(*(enqueuer.enqueue(r) for r in again), return_exceptions=True)
        assert got == [None, None, None, None], got
        lone = harness.request("p", "double", "double", {"value": 9})
        await enqueuer.enqueue(lone)
        read: Any = await client.xrange(keys.stage_stream("double"))
        assert isinstance(read, list)
        assert len(read) == 5, read
    finally:
        await spinner.aclose()
        await client.aclose()
