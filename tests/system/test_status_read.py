"""A stage's status (runtime/status.py: what admission re-reads at most every 50 ms while
calls arrive, and the status page) is one round trip a partition: the parked hash, the
heartbeats and Redis's clock ride in partition 0's; a key of theirs forged to another
type reads as nothing there (no park, no live worker), never as an error. Counted by
Redis itself (``total_reads_processed``) on a redis-server of the test's own."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from pipelines.keys import Keys
from pipelines.records import Parked
from pipelines.settings import CommonSettings
from runtime.redisio import connect, ensure_group
from runtime.status import stage_status

STAGE = "shape"


async def _reads(client: aioredis.Redis) -> int:
    stats: Any = await client.info("stats")
    return int(stats["total_reads_processed"])


async def _stage(client: aioredis.Redis, keys: Keys) -> None:
    """One entry on the stage's stream in each partition, a live and a gone heartbeat."""
    for part in keys.each():
        await ensure_group(client, part.stage_stream(STAGE))
        await client.xadd(part.stage_stream(STAGE), {"e": b"x"})
    seconds, micros = await client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    await client.hset(keys.alive(STAGE), mapping={"w-live": now_ms + 60_000, "w-gone": 5})


@pytest.mark.parametrize("partitions", [1, 2])
async def test_a_stage_status_is_one_round_trip_a_partition(
    own_redis: subprocess.Popen[bytes], namespace: str, partitions: int
) -> None:
    client = connect(CommonSettings())
    try:
        keys = Keys(namespace, partitions)
        await _stage(client, keys)
        parked = Parked(reason="a crash loop", until=time.time() + 60)
        await client.hset(keys.parked(), STAGE, parked.encode())
        before = await _reads(client)
        status = await stage_status(client, keys, STAGE, costs=True)
        # Its reads, and the second INFO's own.
        assert await _reads(client) - before == partitions + 1
        assert status.parked is not None
        assert status.parked.reason == "a crash loop"
        assert {c.name for c in status.consumers if c.alive} == {"w-live"}
        assert (status.length, status.lag) == (partitions, partitions)
    finally:
        await client.aclose()


async def test_forged_park_and_heartbeat_keys_read_as_nothing_there(
    own_redis: subprocess.Popen[bytes], namespace: str
) -> None:
    client = connect(CommonSettings())
    try:
        keys = Keys(namespace)
        await _stage(client, keys)
        await client.delete(keys.alive(STAGE))
        await client.set(keys.alive(STAGE), "not a hash")
        await client.set(keys.parked(), "not a hash either")
        status = await stage_status(client, keys, STAGE, costs=True)
        assert status.parked is None
        assert [c for c in status.consumers if c.alive] == []
        assert (status.length, status.lag) == (1, 1)
    finally:
        await client.aclose()
