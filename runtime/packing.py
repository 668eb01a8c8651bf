"""How conveyor's Redis connections put a command on the wire: packed by hiredis (C) rather
than redis-py's asyncio packer (Python), and written without a task per command.

redis-py's asyncio connections pack every command in Python, at a cost per argument: a
publish's ``EVALSHA`` for a batch of 16 (70 arguments) packs in about a quarter of the
time with hiredis, a gateway's ``XADD`` in under a third (``python -m bench.costs --parts
packing``, which also shows the large commands left to redis-py costing what they did).

:func:`packing` gives a connection class (plain, TLS or Unix socket, as the URL chose)
that packs with hiredis what hiredis packs fast and alike: exact ``bytes``, ``str``,
``int`` and ``float`` arguments, in strict UTF-8, the command under :data:`LARGE` bytes.
Anything else goes to redis-py's own packer, so its bytes, its ``DataError`` (a ``None``,
a ``bool``) and its way with memoryviews and int subclasses stay what they were; and so do
large values, which redis-py passes on without copying while hiredis copies them into one
buffer, past ~200 KB many times slower here (a 1 MB value: 1.6-2.9 ms against under 0.1).
Both :func:`runtime.redisio.connect` and :class:`runtime.cluster.Cluster` (its every
node's connections) use it.

**Writing.** redis-py bounds each write with ``asyncio.wait_for``, which on Python 3.11
wraps the write in a task: a task, a timer and two more turns of the event loop for every
command or pipeline, though the write itself is a ``writelines`` that returns at once when
nothing waits in the connection's buffer (20-40 µs of CPU a round trip here, ``python -m
bench.costs --parts sending``). A ready connection (connected, no health check due,
nothing buffered, not closing) writes so, directly; whatever the write leaves in the
buffer then goes redis-py's way (its drain, bounded by its socket timeout, and its
errors), and a write the socket refused fails as redis-py's does, a ``ConnectionError``
with the connection dropped. Any other connection sends as redis-py does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from hiredis import pack_command
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

LARGE = 64 * 1024
"""Commands whose ``bytes`` and ``str`` arguments hold more than this many bytes (or
characters) together go to redis-py's packer."""


class _HiredisPacking(AbstractConnection):
    """A connection packing its commands with hiredis where that is the same and faster,
    and writing them without a task when it is ready to (see the module's doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        encoder = self.encoder
        self._hiredis = (
            encoder.encoding.lower().replace("-", "").replace("_", "") == "utf8"
            and encoder.encoding_errors == "strict"
        )

    def pack_command(self, *args: Any) -> list[bytes]:
        if not self._hiredis:
            return super().pack_command(*args)
        head = args[0]
        if isinstance(head, str):
            args = (*head.encode().split(), *args[1:])
        elif isinstance(head, bytes) and b" " in head:
            args = (*head.split(), *args[1:])
        size = 0
        for arg in args:
            kind = type(arg)
            if kind is bytes or kind is str:
                size += len(arg)
            elif kind is not int and kind is not float:
                return super().pack_command(*args)
        if size > LARGE:
            return super().pack_command(*args)
        return [pack_command(args)]

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        writer = self._writer
        if (
            writer is None
            or not self.is_connected
            or (check_health and self._health_due())
            or writer.transport.is_closing()
            or writer.transport.get_write_buffer_size()
        ):
            await super().send_packed_command(command, check_health)
            return
        if isinstance(command, str):
            command = command.encode()
        transport = writer.transport
        try:
            writer.writelines([command] if isinstance(command, bytes) else command)
            failed = transport.is_closing()
        except BaseException:  # as redis-py: a command perhaps half written is not reused
            await self.disconnect(nowait=True)
            raise
        if failed:
            # The socket refused it (a connection Redis closed): the transport is closed
            # already, and uvloop would answer redis-py's drain with a RuntimeError.
            await self.disconnect(nowait=True)
            raise RedisConnectionError("Error while writing to socket. Connection lost.")
        if transport.get_write_buffer_size():
            # Part of it waits for the socket: redis-py's drain waits (within its socket
            # timeout) or raises, as after its own write.
            await super().send_packed_command([], check_health=False)

    def _health_due(self) -> bool:
        """Whether redis-py would PING this connection before the next command."""
        return bool(self.health_check_interval) and (
            asyncio.get_running_loop().time() > self.next_health_check
        )


_PACKING: dict[type[Any], type[Any]] = {}


def packing(connection_class: type[Any]) -> type[Any]:
    """``connection_class`` packing its commands with hiredis (the module's doc); one
    class per class, itself for one that packs so already."""
    if issubclass(connection_class, _HiredisPacking):
        return connection_class
    made = _PACKING.get(connection_class)
    if made is None:
        name = f"Packed{connection_class.__name__}"
        made = _PACKING[connection_class] = type(name, (_HiredisPacking, connection_class), {})
    return made


async def transaction(
    client: aioredis.Redis, commands: Sequence[Sequence[EncodableT]]
) -> list[Any]:
    """Run ``commands`` as one MULTI/EXEC on one pooled connection of ``client`` (a plain
    client, not a cluster's), as redis-py's transaction pipeline runs them with
    ``raise_on_error=False``, at a fraction of its CPU.

    redis-py reads each of a transaction's replies (``+OK``, a ``QUEUED`` per command,
    ``EXEC``'s) through its connection's ``read_response``, a timeout armed and cancelled
    for every one, then runs each command's response callback: for a gateway's burst of
    16 enqueues, most of its CPU a request (``python -m bench.enqueue``). Here the
    commands are packed in one buffer and their replies read from the connection's parser
    within one timeout (the connection's socket timeout, as redis-py's per reply), each as
    Redis sent it (no response callbacks: the callers' commands, ``XADD``, have none).

    Returns:
        Per command, its reply, or the error Redis answered it with (that command alone).

    Raises:
        redis.exceptions.ResponseError: the first error Redis refused a command with as it
            was queued (``OOM``: EXEC aborted, nothing ran), else EXEC's own (``BUSY``).
            The connection is dropped: one whose EXEC was refused may still be inside the
            transaction on the server.
        redis.exceptions.ConnectionError, redis.exceptions.TimeoutError: as redis-py's read
            raises them, the connection dropped.
    """
    pool = client.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        packed = connection.pack_commands([("MULTI",), *commands, ("EXEC",)])
        await connection.send_packed_command(packed)
        replies = await _replies(connection, len(commands) + 2)
        refused = [r for r in replies[:-1] if isinstance(r, ResponseError)]
        done = replies[-1]
        if refused or not isinstance(done, list) or len(done) != len(commands):
            await connection.disconnect(nowait=True)
            if refused:
                raise refused[0]
            if isinstance(done, ResponseError):
                raise done
            raise ResponseError(f"EXEC answered {done!r:.100} for {len(commands)} commands")
        return done
    finally:
        await pool.release(connection)


async def _replies(connection: Any, count: int) -> list[Any]:
    """The next ``count`` replies on ``connection``, errors among them as values, read
    from its parser within one socket timeout; on any failure the connection is dropped
    and the failure raised as redis-py's ``read_response`` raises it."""
    parser = getattr(connection, "_parser", None)
    if parser is None:  # a redis-py without it: its own read, one reply at a time
        return [await _reply(connection) for _ in range(count)]
    try:
        async with asyncio.timeout(connection.socket_timeout):
            replies = [await parser.read_response() for _ in range(count)]
    except BaseException as exc:
        await connection.disconnect(nowait=True)
        if isinstance(exc, asyncio.TimeoutError):
            raise RedisTimeoutError(f"Timeout reading from {connection.host}") from None
        if isinstance(exc, OSError):
            raise RedisConnectionError(f"Error while reading: {exc.args}") from exc
        raise
    if connection.health_check_interval:  # read_response's own bookkeeping
        loop = asyncio.get_running_loop()
        connection.next_health_check = loop.time() + connection.health_check_interval
    return replies


async def _reply(connection: Any) -> Any:
    try:
        return await connection.read_response()
    except ResponseError as exc:
        return exc
