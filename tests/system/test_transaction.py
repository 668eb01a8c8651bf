"""One MULTI/EXEC read at a fraction of redis-py's cost (runtime/packing.py: transaction):
each command's reply as Redis sent it, a command's own error its own, and a transaction cut
short (a paused Redis, a cancelled caller) leaves nothing on the connection for the next."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ExecAbortError, OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from conveyor.embedded import free_port, start_redis
from pipelines.settings import CommonSettings
from runtime.packing import _cause, transaction
from runtime.redisio import RedisRefused, connect


async def test_each_command_is_answered_in_order_and_an_error_is_its_own(
    redis: aioredis.Redis, namespace: str
) -> None:
    key, text = f"{namespace}:n", f"{namespace}:s"
    await redis.set(text, "not a list")
    got = await transaction(
        redis,
        [
            ("SET", key, 41),
            ("INCR", key),
            ("LPUSH", text, "x"),  # WRONGTYPE: this command alone
            ("GET", key),
            ("XADD", f"{namespace}:st", "*", "e", b"\x00\xff"),
        ],
    )
    assert got[:2] == [b"OK", 42]
    assert isinstance(got[2], ResponseError)
    assert "WRONGTYPE" in str(got[2])
    assert got[3] == b"42"
    assert isinstance(got[4], bytes)
    entries: Any = await redis.xrange(f"{namespace}:st")
    assert entries == [(got[4], {b"e": b"\x00\xff"})]
    assert await redis.get(text) == b"not a list"


async def test_a_command_refused_as_it_is_queued_aborts_all_and_raises(
    redis: aioredis.Redis, namespace: str
) -> None:
    with pytest.raises(ResponseError, match="wrong number of arguments"):
        await transaction(redis, [("SET", f"{namespace}:a", 1), ("GET",)])
    assert not await redis.exists(f"{namespace}:a")  # EXEC aborted: nothing ran
    assert await transaction(redis, [("SET", f"{namespace}:a", 2)]) == [b"OK"]


async def cut_short(own_redis: subprocess.Popen[bytes], namespace: str, how: str) -> None:
    """A transaction on a paused Redis ends (its socket timeout, or its caller cancelled);
    once Redis resumes, the same one-connection client answers the next transactions with
    their own replies, not the first one's."""
    settings = CommonSettings(redis_timeout_s=0.5)
    client = connect(settings, connections=1)
    key = f"{namespace}:n"
    try:
        assert await transaction(client, [("SET", key, 0)]) == [b"OK"]
        own_redis.send_signal(signal.SIGSTOP)
        stuck = asyncio.ensure_future(transaction(client, [("INCR", key), ("GET", key)]))
        if how == "timeout":
            with pytest.raises(RedisTimeoutError):
                await asyncio.wait_for(stuck, 10)
        else:
            await asyncio.sleep(0.1)  # sent, waiting for its replies
            stuck.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stuck
        own_redis.send_signal(signal.SIGCONT)
        for _ in range(3):
            got = await transaction(client, [("SET", key, 7), ("INCR", key), ("GET", key)])
            assert got == [b"OK", 8, b"8"]
    finally:
        own_redis.send_signal(signal.SIGCONT)
        await client.aclose()


async def test_a_transaction_past_its_timeout_leaves_no_reply_behind(
    own_redis: subprocess.Popen[bytes], namespace: str
) -> None:
    await cut_short(own_redis, namespace, "timeout")


async def test_a_cancelled_transaction_leaves_no_reply_behind(
    own_redis: subprocess.Popen[bytes], namespace: str
) -> None:
    await cut_short(own_redis, namespace, "cancel")


async def test_a_transaction_whose_redis_dies_midway_fails_as_a_lost_connection(
    own_redis: subprocess.Popen[bytes], namespace: str, tmp_path: Path
) -> None:
    client = connect(CommonSettings(), connections=1)
    url = os.environ["CONVEYOR_REDIS_URL"]
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    again = None
    try:
        assert await transaction(client, [("SET", f"{namespace}:k", 1)]) == [b"OK"]
        own_redis.send_signal(signal.SIGSTOP)
        stuck = asyncio.ensure_future(transaction(client, [("GET", f"{namespace}:k")]))
        await asyncio.sleep(0.1)  # sent, waiting for its replies
        own_redis.kill()  # its sockets close under the read
        own_redis.wait(10)
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(stuck, 10)
        again = start_redis(port, tmp_path)
        assert await transaction(
            client, [("SET", f"{namespace}:k", 2), ("GET", f"{namespace}:k")]
        ) == [b"OK", b"2"]
    finally:
        await client.aclose()
        if again is not None:
            again.terminate()
            again.wait(10)


async def test_a_transaction_on_a_unix_socket_past_its_timeout_fails_as_a_timeout(
    tmp_path: Path, namespace: str
) -> None:
    socket = tmp_path / "redis.sock"
    server = start_redis(free_port(), tmp_path, unixsocket=socket)
    client = connect(CommonSettings(redis_url=f"unix://{socket}", redis_timeout_s=0.5))
    try:
        assert await transaction(client, [("SET", f"{namespace}:k", 1)]) == [b"OK"]
        server.send_signal(signal.SIGSTOP)
        with pytest.raises(RedisTimeoutError, match=r"redis\.sock"):
            await transaction(client, [("GET", f"{namespace}:k")])
        server.send_signal(signal.SIGCONT)
        assert await transaction(client, [("GET", f"{namespace}:k")]) == [b"1"]
    finally:
        server.send_signal(signal.SIGCONT)
        await client.aclose()
        server.terminate()
        server.wait(10)


async def test_a_transaction_redis_discards_raises_its_refusal_and_keeps_the_connection(
    own_redis: subprocess.Popen[bytes], namespace: str
) -> None:
    client = connect(CommonSettings(), connections=1)
    try:
        (first,) = await transaction(client, [("CLIENT", "ID")])
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", 1)
        for _ in range(3):
            with pytest.raises(OutOfMemoryError):
                await transaction(client, [("XADD", f"{namespace}:s", "*", "e", "x")])
        await client.config_set("maxmemory", 0)
        # The same connection throughout: Redis left it outside the transaction.
        assert await transaction(client, [("CLIENT", "ID")]) == [first]
        assert not await client.exists(f"{namespace}:s")
    finally:
        await client.config_set("maxmemory", 0)
        await client.aclose()


@pytest.mark.parametrize(
    ("said", "kind"),
    [
        ("OOM command not allowed when used memory > 'maxmemory'.", OutOfMemoryError),
        ("BUSY Redis is busy running a script.", RedisRefused),
        ("READONLY You can't write against a read only replica.", ReadOnlyError),
        ("ERR something else", ResponseError),
    ],
)
def test_an_exec_refused_alone_is_raised_as_its_cause(said: str, kind: type) -> None:
    # EXEC refused though every command was queued (Redis 7: EXECABORT, with the cause).
    connection = connect(CommonSettings()).connection_pool.make_connection()  # type: ignore[no-untyped-call]
    connection._parser.on_connect(connection)
    cause = _cause(connection, ExecAbortError(f"Transaction discarded because of: {said}"))
    assert type(cause) is kind
    assert said.split(" ", 1)[1] in str(cause)
