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

**Reading.** redis-py reads every reply through its connection's ``read_response``, a
timeout armed and cancelled per reply, then a response callback: a pipeline of n commands
pays that n times. :func:`transaction` (a MULTI/EXEC: a gateway's burst of enqueues),
:func:`pipelined` (a worker's claim) and :func:`command` (a publish's ``EVALSHA``) send
their commands in one buffer and read the replies straight from the connection's parser
within one timeout, each as Redis sent it; a connection whose read failed or was cut short
is dropped, so no reply is left on it for the next caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from hiredis import pack_command
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ExecAbortError, ResponseError
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
        redis.exceptions.ResponseError: Redis discarded the transaction (nothing ran): the
            first error a command was refused with as it was queued (``OOM``), else the
            reason EXEC was refused for (``OOM``, ``BUSY``: as the parser classes it, so
            a refusal is one of :data:`runtime.redisio.REFUSED`). The connection is kept:
            Redis left it outside any transaction. Any other error of MULTI or EXEC is
            raised with the connection dropped (MULTI refused: the commands may have run
            outside a transaction; an EXEC refused otherwise may have left it inside one).
        redis.exceptions.ConnectionError, redis.exceptions.TimeoutError: as redis-py's read
            raises them, the connection dropped.
    """
    pool = client.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        packed = connection.pack_commands([("MULTI",), *commands, ("EXEC",)])
        await connection.send_packed_command(packed)
        replies = await _replies(connection, len(commands) + 2)
        began, queued, done = replies[0], replies[1:-1], replies[-1]
        if isinstance(done, list) and len(done) == len(commands) and began in _OK:
            return done
        if began in _OK and isinstance(done, ExecAbortError):
            refused = [r for r in queued if isinstance(r, ResponseError)]
            raise refused[0] if refused else _cause(connection, done)
        await connection.disconnect(nowait=True)
        for answer in (began, done):
            if isinstance(answer, ResponseError):
                raise answer
        raise ResponseError(f"EXEC answered {done!r:.100} for {len(commands)} commands")
    finally:
        # Shielded as redis-py's pipeline shields it: a cancel midway through a contended
        # release would leave the connection counted in use for good.
        await asyncio.shield(pool.release(connection))


_OK = (b"OK", "OK")


def _cause(connection: Any, aborted: ExecAbortError) -> ResponseError:
    """Why Redis discarded a transaction at its EXEC (``EXECABORT Transaction discarded
    because of: OOM ...``), as the connection's parser classes that error."""
    _, found, said = str(aborted).partition("because of: ")
    parser = getattr(connection, "_parser", None)
    if not found or parser is None:
        return aborted
    cause: ResponseError = parser.parse_error(said)
    return cause


async def _replies(connection: Any, count: int) -> list[Any]:
    """The next ``count`` replies on ``connection``, errors among them as values, read
    from its parser within one socket timeout; on any failure the connection is dropped
    and the failure raised as redis-py's ``read_response`` raises it."""
    parser = connection._parser
    try:
        async with asyncio.timeout(connection.socket_timeout) as timeout:
            # Where redis-py keeps its read's timeout (a maintenance notice may extend it).
            connection._active_read_timeout = timeout
            replies = [await parser.read_response() for _ in range(count)]
    except BaseException as exc:
        await connection.disconnect(nowait=True)
        where = connection._host_error()  # as redis-py names the server in its errors
        if isinstance(exc, asyncio.TimeoutError):
            raise RedisTimeoutError(f"Timeout reading from {where}") from None
        if isinstance(exc, OSError):
            raise RedisConnectionError(f"Error while reading from {where}: {exc.args}") from exc
        raise
    finally:
        connection._active_read_timeout = None
    if connection.health_check_interval:  # read_response's own bookkeeping
        loop = asyncio.get_running_loop()
        connection.next_health_check = loop.time() + connection.health_check_interval
    return replies


async def pipelined(
    client: aioredis.Redis, commands: Sequence[Sequence[EncodableT]], *, raise_on_error: bool
) -> list[Any]:
    """Run ``commands`` in one round trip on one pooled connection of ``client``, not as a
    transaction, as redis-py's pipeline runs them, their replies read as
    :func:`transaction` reads them (each as Redis sent it): a worker's claim of HSET and
    MGET for 72 against 101 µs of CPU here (``python -m bench.enqueue --round-trips``).
    A cluster client's go through its own pipeline (replies as its callbacks make them).

    Returns:
        Per command, its reply, or (without ``raise_on_error``) the error Redis answered
        it with.

    Raises:
        redis.exceptions.ResponseError: with ``raise_on_error``, the first command's error,
            once every reply is read.
        redis.exceptions.ConnectionError, redis.exceptions.TimeoutError: as redis-py's read
            raises them, the connection dropped.
    """
    if isinstance(client, RedisCluster):
        pipe = client.pipeline(transaction=False)
        for args in commands:
            pipe.execute_command(*args)
        return list(await pipe.execute(raise_on_error=raise_on_error))
    pool = client.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        await connection.send_packed_command(connection.pack_commands(commands))
        replies = await _replies(connection, len(commands))
    finally:
        await asyncio.shield(pool.release(connection))
    if raise_on_error:
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
    return replies


async def command(client: aioredis.Redis, *args: EncodableT) -> Any:
    """One command's reply, as Redis sent it (:func:`pipelined`), its error raised; a
    cluster client's through its own ``execute_command``."""
    if isinstance(client, RedisCluster):
        return await client.execute_command(*args)
    return (await pipelined(client, [args], raise_on_error=True))[0]
