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
from collections.abc import Iterable
from typing import Any

from hiredis import pack_command
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError

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
