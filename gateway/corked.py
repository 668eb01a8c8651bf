"""A connection's transport that sends what is written in one loop iteration in one
``write`` (:class:`Corked`), for :mod:`gateway.protocol`."""

from __future__ import annotations

import asyncio
from typing import Any


class Corked:
    """A transport whose writes within one loop iteration leave in one ``write``.

    uvicorn writes a response's status line and headers, then its body: two writes, and
    on loopback TCP each is a system call that also does the receiver's work. Held until
    the end of the iteration they become one, whatever the app sends in between. A close
    sends what is held first; everything else is the transport's own.

    Args:
        transport: the connection's transport.
        loop: the loop it runs on.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._held: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Hold ``data`` until the end of this loop iteration."""
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(bytes(data))

    def send(self, data: bytes) -> None:
        """Write ``data`` now, after what is held: a whole response, which nothing else in
        this iteration should wait behind (the access line, the next reply read)."""
        self._held.append(data)
        self.flush()  # alone, it is written as it is (no join)

    def flush(self) -> None:
        """Write what is held (nothing once the transport is closing)."""
        if self._held:
            data = b"".join(self._held) if len(self._held) > 1 else self._held[0]
            self._held = []
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        """Write what is held, then close."""
        self.flush()
        self._transport.close()
