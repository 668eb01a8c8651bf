"""The connection pool of a plain (not cluster) Redis client: blocking past its bound,
with :class:`PoolExhausted` when the wait runs out, and a short way for a free connection."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError


class PoolExhausted(RedisConnectionError):
    """No pooled connection came free within the pool's timeout.

    This process has more commands in flight than connections (a burst, CPU contention
    slowing every round trip), while Redis itself may be answering well: overload, not an
    outage. It stays a ``ConnectionError`` (in :data:`REDIS_DOWN`), so code that just backs
    off and retries keeps doing so; the gateway answers it as overload.

    Args:
        timeout_s: how long the command waited for a connection.
    """

    def __init__(self, timeout_s: float | None) -> None:
        super().__init__(f"no free Redis connection within {timeout_s or 0:g}s")
        self.timeout_s = timeout_s


class Pool(aioredis.BlockingConnectionPool):
    """A blocking pool whose wait running out raises :class:`PoolExhausted`, with a short
    way for the common case.

    redis-py 8's blocking pool takes a condition, a timeout, a lock and its own metrics
    hooks for every command, also when a connection is free: about a tenth of a worker's
    CPU per batch (issue 37). When a connection is free (or may be made) and nobody
    waits for one, it is handed out (connected, and checked for unread data as redis-py
    checks it) and taken back without them (and without a task: :meth:`release`);
    otherwise, and on a redis-py whose pool lacks what this reads, the pool's own way
    runs.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._short = (
            all(
                hasattr(self, name)
                for name in (
                    "_available_connections",
                    "_in_use_connections",
                    "_lock",
                    "_condition",
                    "get_available_connection",
                )
            )
            # redis-py before 7 has neither on its connections (nor checks them).
            and all(
                hasattr(self.connection_class, name) for name in ("can_read", "should_reconnect")
            )
            and isinstance(getattr(self._condition, "_waiters", None), deque)
        )

    def _quiet(self) -> bool:
        """Nobody waits for a connection and no maintenance holds the pool."""
        return (
            self._short
            and not self._condition._waiters
            and not self._lock.locked()
            and not getattr(self, "_in_maintenance", False)
        )

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self._quiet() and (
            self._available_connections or len(self._in_use_connections) < self.max_connections
        ):
            connection = self.get_available_connection()  # type: ignore[no-untyped-call]
            try:
                if not connection.is_connected:
                    await connection.connect()
                if await connection.can_read():  # left with unread data, or closed
                    await connection.disconnect()
                    await connection.connect()
                    if await connection.can_read():
                        raise RedisConnectionError("Connection not ready")
            except BaseException:
                await self.release(connection)
                raise
            return connection
        try:
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        except PoolExhausted:
            raise
        except RedisConnectionError as exc:
            # redis-py 8 says a wait that ran out with ConnectionError("No connection
            # available.") raised from the asyncio timeout; a connection that fails to
            # connect raises ConnectionError from an OSError, or Redis's TimeoutError.
            if isinstance(exc.__cause__, asyncio.TimeoutError):
                raise PoolExhausted(self.timeout) from exc
            raise

    def release(self, connection: Any) -> Awaitable[None]:  # type: ignore[override]
        """Take ``connection`` back. On the short way the answer is a finished future, not
        a coroutine: redis-py's pipeline shields its release (``asyncio.shield``), which
        runs a coroutine as a task of its own (and the caller waits for its turn of the
        loop) but takes a finished future as it is."""
        if not (self._quiet() and connection in self._in_use_connections):
            return super().release(connection)
        self._in_use_connections.remove(connection)
        if connection.should_reconnect():
            return self._reconnected(connection)
        self._available_connections.append(connection)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def _reconnected(self, connection: Any) -> None:
        """Put ``connection``, taken out of use, back once it is disconnected (the short
        way's one wait: it reconnects when next handed out)."""
        await connection.disconnect()
        self._available_connections.append(connection)


SATURATED = (PoolExhausted, MaxConnectionsError)
"""This process's connections to Redis are all in use (the cluster client's per-node
bound raises the second): overload here, not an outage; nothing was sent."""
