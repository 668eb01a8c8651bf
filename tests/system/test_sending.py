"""Commands written directly by a ready connection (runtime/packing.py): no task per write,
the health check still first when due, a command larger than the socket takes still
whole, and the failures of redis-py's own write (a connection Redis closed, a Redis that
stopped reading) still raised as its errors, within its timeout; and a pipeline's
connection taken back without a task (runtime/pool.py). Each on asyncio's loop and on
uvloop, which conveyor's processes run on (it fails a write differently)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import uvloop
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from conveyor.embedded import free_port, start_redis
from pipelines.settings import CommonSettings
from runtime.packing import packing
from runtime.pool import Pool
from runtime.redisio import connect
from tests.helpers import until

LOOPS = ("asyncio", "uvloop")


def _run(loop: str, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    (uvloop.run if loop == "uvloop" else asyncio.run)(main())


async def _tasks_made(work: Awaitable[Any]) -> int:
    """How many tasks the event loop made while ``work`` ran."""
    running = asyncio.get_running_loop()
    made = 0
    before = running.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        nonlocal made
        made += 1
        return asyncio.Task(coro, loop=loop, **kwargs)

    running.set_task_factory(factory)
    try:
        await work
    finally:
        running.set_task_factory(before)
    return made


@pytest.mark.parametrize("loop", LOOPS)
def test_a_ready_connection_writes_commands_and_pipelines_without_a_task(
    env: None, loop: str
) -> None:
    """redis-py's write is an ``asyncio.wait_for`` (on Python 3.11 a task per command), and
    its pipeline shields the connection's release (a task per pipeline)."""
    key = f"t{uuid.uuid4().hex}"

    async def main() -> None:
        redis = connect(CommonSettings())
        await redis.ping()  # connected: the next commands find a ready connection

        async def work() -> None:
            await redis.set(key, "v")
            assert await redis.get(key) == b"v"
            for transaction in (False, True):
                pipe = redis.pipeline(transaction=transaction)
                pipe.hset(key + ":h", mapping={"a": "1"})
                pipe.mget(key, key + ":none")
                assert (await pipe.execute())[1] == [b"v", None]

        try:
            assert await _tasks_made(work()) == 0
        finally:
            await redis.delete(key, key + ":h")
            await redis.aclose()

    _run(loop, main)


async def _pings(client: aioredis.Redis) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_ping", {}).get("calls", 0))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_due_health_check_still_pings_before_the_command(env: None, loop: str) -> None:
    async def main() -> None:
        redis = connect(CommonSettings())
        kwargs = redis.connection_pool.connection_kwargs
        conn = packing(Connection)(
            host=kwargs["host"], port=kwargs["port"], health_check_interval=30
        )
        await conn.connect()
        try:
            before = await _pings(redis)
            await conn.send_command("ECHO", "not yet due")
            assert await conn.read_response() == b"not yet due"
            assert await _pings(redis) == before  # the connect's own check: not due again
            conn.next_health_check = -1.0  # due: redis-py would PING first
            await conn.send_command("ECHO", "due")
            assert await conn.read_response() == b"due"
            assert await _pings(redis) == before + 1
        finally:
            await conn.disconnect()
            await redis.aclose()

    _run(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_command_larger_than_the_socket_takes_arrives_whole(env: None, loop: str) -> None:
    """Eight MB is past what the kernel takes at once: the rest waits in the transport's
    buffer and goes redis-py's way (its drain); the next command finds the connection
    clean."""
    key = f"t{uuid.uuid4().hex}"
    big = bytes(range(256)) * (8 * 1024 * 1024 // 256)

    async def main() -> None:
        redis = connect(CommonSettings())
        try:
            await redis.set(key, big)
            assert await redis.get(key) == big
            pipe = redis.pipeline(transaction=True)
            pipe.set(key, big[::-1])
            pipe.strlen(key)
            assert (await pipe.execute())[1] == len(big)
            assert await redis.get(key) == big[::-1]
            assert await redis.ping()
        finally:
            await redis.delete(key)
            await redis.aclose()

    _run(loop, main)


async def _killed(conn: Connection, admin: aioredis.Redis) -> None:
    """``conn`` connected, then closed by Redis (CLIENT KILL), and the close seen here."""
    await conn.connect()  # type: ignore[no-untyped-call]
    await conn.send_command("CLIENT", "ID")
    own = await conn.read_response()
    await admin.client_kill_filter(_id=own)
    reader = conn._reader
    assert reader is not None

    async def closed() -> bool:
        return reader.at_eof()

    await until(closed, limit_s=10)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
def test_a_write_on_a_connection_redis_closed_fails_as_a_connection_error(
    tmp_path: Path, loop: str, unix: bool
) -> None:
    """Redis closes the connection. The first write after it may still be taken (the
    socket is half open); a write the socket refuses fails as redis-py's own write
    fails, a ``ConnectionError`` with the connection dropped: not uvloop's RuntimeError
    for its closed transport. The next command connects afresh."""
    port = free_port()
    socket_path = tmp_path / "redis.sock"
    server = start_redis(port, tmp_path / "redis", unixsocket=socket_path)
    try:

        async def main() -> None:
            admin = aioredis.Redis(port=port)
            if unix:
                conn: Connection = packing(UnixDomainSocketConnection)(path=str(socket_path))
            else:
                conn = packing(Connection)(host="127.0.0.1", port=port)
            try:
                await _killed(conn, admin)
                failed: list[RedisConnectionError] = []

                async def refused() -> bool:  # writes, after the close: one is refused
                    try:
                        await conn.send_command("PING")
                    except RedisConnectionError as exc:  # anything else fails the test
                        failed.append(exc)
                    return bool(failed)

                await until(refused, limit_s=10)
                assert "writing" in str(failed[0])
                assert not conn.is_connected
                await conn.send_command("PING")  # connects again
                assert await conn.read_response() in (b"PONG", "PONG")
            finally:
                await conn.disconnect()
                await admin.aclose()

        _run(loop, main)
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_write_redis_does_not_read_times_out_within_the_socket_timeout(
    own_redis: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    """A stopped redis-server reads nothing: a command past the socket's room waits in the
    buffer, and the write fails within the socket timeout (redis-py's drain), not never."""
    monkeypatch.setenv("CONVEYOR_REDIS_TIMEOUT_S", "0.5")

    async def main() -> None:
        client = connect(CommonSettings())
        try:
            await client.ping()
            (conn,) = client.connection_pool._available_connections
            assert conn._writer is not None
            transport = conn._writer.transport
            own_redis.send_signal(signal.SIGSTOP)
            started = asyncio.get_running_loop().time()
            with pytest.raises(RedisTimeoutError, match="writing"):  # the write's, not the read's
                await client.set("k", b"x" * (32 * 1024 * 1024))
            assert asyncio.get_running_loop().time() - started < 30  # bounded: not stuck
        finally:
            own_redis.send_signal(signal.SIGCONT)

            async def drained() -> bool:  # uvloop will not close a loop with a transport
                return transport.get_write_buffer_size() == 0  # still writing

            await until(drained, limit_s=30)
            await client.aclose()

    _run(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_release_with_someone_waiting_takes_the_pools_own_way(env: None, loop: str) -> None:
    """With every connection out and a command waiting for one, a release is the pool's
    own (a coroutine that wakes the waiter), and the waiting command runs; with nobody
    waiting it is a finished future, and a connection marked to reconnect is taken back
    disconnected."""

    async def main() -> None:
        pool = Pool.from_url(CommonSettings().redis_url, max_connections=1, timeout=5)
        client = aioredis.Redis.from_pool(pool)
        try:
            await client.ping()
            held = await pool.get_connection()
            waiting = asyncio.ensure_future(client.echo("waited"))

            async def queued() -> bool:
                return bool(pool._condition._waiters)

            await until(queued, limit_s=10)
            assert not waiting.done()  # no connection free: it waits
            released = pool.release(held)
            assert asyncio.iscoroutine(released)  # not the short way
            await released
            assert await waiting == b"waited"
            conn = await pool.get_connection()
            quick = pool.release(conn)  # nobody waits: the short way
            assert isinstance(quick, asyncio.Future)
            assert quick.done()
            await quick
            conn = await pool.get_connection()
            conn.mark_for_reconnect()  # taken back disconnected, then handed out anew
            again = pool.release(conn)
            assert asyncio.iscoroutine(again)
            await again
            assert not conn.is_connected
            assert conn in pool._available_connections
            assert await client.echo("after") == b"after"
        finally:
            await client.aclose()

    _run(loop, main)
