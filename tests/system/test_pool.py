"""The connection pool's short way (runtime/pool.py): a free connection is handed out
without the blocking pool's condition, yet the bound, the wait, its timeout, the waiters'
turn and the check for unread data all hold. Real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest
import redis.asyncio as aioredis

from pipelines.settings import CommonSettings
from runtime.pool import Pool, PoolExhausted
from runtime.redisio import connect
from tests.helpers import until


def task(call: Awaitable[Any]) -> asyncio.Task[Any]:
    async def run() -> Any:
        return await call

    return asyncio.create_task(run())


def client(monkeypatch: pytest.MonkeyPatch, most: int, timeout_s: float) -> aioredis.Redis:
    monkeypatch.setenv("CONVEYOR_REDIS_MAX_CONNECTIONS", str(most))
    monkeypatch.setenv("CONVEYOR_REDIS_TIMEOUT_S", str(timeout_s))
    c = connect(CommonSettings(), block_ms=5000)
    assert isinstance(c.connection_pool, Pool)
    return c


@contextlib.asynccontextmanager
async def pooled(
    monkeypatch: pytest.MonkeyPatch, most: int, timeout_s: float
) -> AsyncIterator[aioredis.Redis]:
    """:func:`client`, closed on the way out."""
    c = client(monkeypatch, most, timeout_s)
    try:
        yield c
    finally:
        await c.aclose()


async def blocked(redis: aioredis.Redis, n: int) -> None:
    """Wait until Redis holds ``n`` clients blocked in a BLPOP (sent, each on a pooled
    connection of its own); the session's Redis may hold other blocked readers."""

    async def holds() -> bool:
        listed = await redis.client_list()
        return sum(1 for c in listed if c["cmd"] == "blpop" and "b" in c["flags"]) == n

    await until(holds, limit_s=10)


async def test_the_short_way_is_taken_and_reuses_one_connection(
    env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with pooled(monkeypatch, 4, 2.0) as c:
        pool = c.connection_pool
        assert isinstance(pool, Pool)
        assert pool._short  # this redis-py's pool has what the short way reads
        for _ in range(20):
            assert await c.ping()
        # One command at a time: one connection made, and back in the pool.
        assert len(pool._available_connections) == 1
        assert not pool._in_use_connections


async def test_past_its_bound_a_command_waits_for_a_free_connection(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = f"test:{uuid.uuid4().hex}"
    async with pooled(monkeypatch, 2, 5.0) as c:
        # Two blocking reads hold both connections; a third command waits for one, and
        # runs once the first read ends (a waiter is served, not passed over).
        first = task(c.blpop([key], timeout=1))
        second = task(c.blpop([key + ":2"], timeout=5))
        await blocked(redis, 2)
        started = time.monotonic()
        assert await c.ping()
        waited = time.monotonic() - started
        assert await first is None
        assert waited > 0.3  # it waited for the first read's end, not a new connection
        await c.rpush(key + ":2", "x")
        assert await second is not None
        assert c.connection_pool._in_use_connections == set()


async def test_a_wait_that_runs_out_is_pool_exhausted(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = f"test:{uuid.uuid4().hex}"
    async with pooled(monkeypatch, 2, 0.3) as c:
        held = [task(c.blpop([f"{key}:{i}"], timeout=3)) for i in range(2)]
        await blocked(redis, 2)
        with pytest.raises(PoolExhausted):
            await c.ping()
        for i in range(2):  # from another client: this one's are all held
            await redis.rpush(f"{key}:{i}", "x")
        assert all(r is not None for r in await asyncio.gather(*held))
        assert await c.ping()  # and the pool serves again


async def test_a_connection_left_with_unread_data_is_not_handed_out(
    env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with pooled(monkeypatch, 2, 2.0) as c:
        pool = c.connection_pool
        assert await c.ping()
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        # Forged: a reply nobody read (what a cancelled command can leave behind).
        await conn.send_command("PING")

        async def arrived() -> bool:
            return bool(await conn.can_read())

        await until(arrived, limit_s=10)
        await pool.release(conn)
        # The next command must not read that stale reply as its own.
        assert await c.echo("mine") == b"mine"
        assert await c.set(f"test:{uuid.uuid4().hex}", "1") is True
