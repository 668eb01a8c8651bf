"""One MULTI/EXEC read at a fraction of redis-py's cost (runtime/packing.py: transaction):
each command's reply as Redis sent it, a command's own error its own, and a transaction cut
short (a paused Redis, a cancelled caller) leaves nothing on the connection for the next."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipelines.settings import CommonSettings
from runtime.packing import transaction
from runtime.redisio import connect


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


async def test_a_transaction_on_a_connection_redis_closed_fails_as_a_lost_connection(
    own_redis: subprocess.Popen[bytes], namespace: str
) -> None:
    client = connect(CommonSettings(), connections=1)
    try:
        assert await transaction(client, [("SET", f"{namespace}:k", 1)]) == [b"OK"]
        await client.client_kill_filter(skipme=False, _type="normal")  # every client, ours too
        with pytest.raises(RedisConnectionError):
            await transaction(client, [("GET", f"{namespace}:k")])
        assert await transaction(client, [("GET", f"{namespace}:k")]) == [b"1"]
    finally:
        await client.aclose()
