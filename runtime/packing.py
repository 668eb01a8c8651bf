"""Redis commands packed by hiredis (C) rather than redis-py's asyncio packer (Python).

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
"""

from __future__ import annotations

from typing import Any

from hiredis import pack_command
from redis.asyncio.connection import AbstractConnection

LARGE = 64 * 1024
"""Commands whose ``bytes`` and ``str`` arguments hold more than this many bytes (or
characters) together go to redis-py's packer."""


class _HiredisPacking(AbstractConnection):
    """A connection packing its commands with hiredis where that is the same and faster
    (see the module's doc)."""

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
