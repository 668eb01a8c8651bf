"""The pool's short way (runtime/pool.py) under faults: Redis restarted under idle pooled
connections, a command cancelled in flight, waiters cancelled while every connection is
held. Real Redis."""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from conveyor.embedded import start_redis
from runtime.pool import Pool
from runtime.redisio import on_live_connection
from tests.helpers import until
from tests.system.test_pool import blocked, client, pooled, task


async def test_a_restarted_redis_is_reconnected_on_the_next_command(
    own_redis: subprocess.Popen[bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = client(monkeypatch, 2, 2.0)
    pool = c.connection_pool
    port = int(os.environ["CONVEYOR_REDIS_URL"].rsplit(":", 1)[1].split("/")[0])
    again: subprocess.Popen[bytes] | None = None
    try:
        # Two connections made, both idle in the pool.
        await asyncio.gather(c.ping(), c.ping())
        assert len(pool._available_connections) == 2
        own_redis.terminate()
        own_redis.wait(timeout=10)
        again = start_redis(port, tmp_path / "again")
        # Each pooled connection is dead: the first command finds one so and, retried
        # once (on_live_connection), runs on a fresh one; the other idle one was dropped
        # with it, so no later command fails on it.
        assert await on_live_connection(c, c.ping)
        for _ in range(4):
            assert await c.ping()
        assert list(await asyncio.gather(c.echo("a"), c.echo("b"))) == [b"a", b"b"]
        assert not pool._in_use_connections
    finally:
        await c.aclose()
        if again is not None:
            again.terminate()
            again.wait(timeout=10)


async def test_a_command_cancelled_in_flight_leaves_no_reply_for_the_next(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = f"test:{uuid.uuid4().hex}"
    async with pooled(monkeypatch, 2, 2.0) as c:
        waiting = task(c.blpop([key], timeout=30))
        await blocked(redis, 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # The cancelled BLPOP's connection is closed, not left blocked in Redis to be
        # handed out again (its reply would go to the next command, or take what is
        # pushed next and lose it).
        await blocked(redis, 0)
        await redis.rpush(key, "x")
        assert await c.echo("mine") == b"mine"
        assert await redis.lrange(key, 0, -1) == [b"x"]
        assert await c.lpop(key) == b"x"
        assert not c.connection_pool._in_use_connections


async def test_waiters_cancelled_while_the_pool_is_full_leave_it_bounded_and_serving(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = f"test:{uuid.uuid4().hex}"
    async with pooled(monkeypatch, 2, 5.0) as c:
        pool = c.connection_pool
        assert isinstance(pool, Pool)
        held = [task(c.blpop([f"{key}:{i}"], timeout=5)) for i in range(2)]

        async def all_wait() -> bool:
            return len(pool._condition._waiters) == 10

        await blocked(redis, 2)
        waiters = [task(c.echo(str(i))) for i in range(10)]
        await until(all_wait, limit_s=5)
        for w in waiters[::2]:
            w.cancel()
        for i in range(2):
            await redis.rpush(f"{key}:{i}", "x")
        assert all(r is not None for r in await asyncio.gather(*held))
        served = await asyncio.wait_for(asyncio.gather(*waiters[1::2]), 5)
        assert served == [str(i).encode() for i in range(1, 10, 2)]
        assert all(w.cancelled() for w in waiters[::2])
        assert not pool._in_use_connections
        assert len(pool._available_connections) <= 2
        assert await asyncio.gather(*(c.echo(str(i)) for i in range(8))) == [
            str(i).encode() for i in range(8)
        ]
        assert len(pool._available_connections) <= 2


class _Before7:
    """A connection as redis-py 5 and 6 make it: no ``can_read`` (its check is called
    ``can_read_destructive``), no ``should_reconnect``."""

    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs


def test_a_pool_of_connections_without_what_the_short_way_calls_keeps_its_own_way() -> None:
    # redis-py 6.2 (which pyproject's redis>=5.0 allows): the short way's release called
    # should_reconnect() and failed every command with AttributeError.
    assert not Pool(connection_class=_Before7)._short
    assert Pool()._short  # this redis-py's: taken
