"""A lean closed-loop HTTP/1.1 load generator.

On a two-core machine the load generator shares the CPU with what it measures; httpx
spends about a millisecond of CPU per request, enough to become the bottleneck at high
concurrency. This client writes requests and parses responses by hand over keep-alive
connections, which costs a small fraction of that.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class LoadResult:
    """Outcome of one closed-loop run.

    Attributes:
        requests: requests sent.
        errors: responses other than 200 (and connection failures).
        seconds: wall time of the run.
        latencies: per request, seconds.
        statuses: count per status code.
    """

    requests: int
    errors: int
    seconds: float
    latencies: list[float]
    statuses: dict[int, int] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Successful requests per second."""
        return (self.requests - self.errors) / self.seconds

    def pct(self, q: float) -> float:
        """Latency quantile ``q`` (0..1) in milliseconds."""
        ordered = sorted(self.latencies)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Connection:
    """One keep-alive HTTP/1.1 connection.

    Args:
        host: server address.
        port: server port.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """Send a JSON POST and return (status, body)."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self._writer.write(head.encode() + body)
        status = int((await self._reader.readline()).split(b" ", 2)[1])
        length = 0
        close = False
        while (line := await self._reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            lowered = name.strip().lower()
            if lowered == b"content-length":
                length = int(value)
            elif lowered == b"connection" and value.strip().lower() == b"close":
                close = True
        payload = await self._reader.readexactly(length)
        if close:
            await self.close()
        return status, payload

    async def close(self) -> None:
        """Close the connection (a later post reconnects)."""
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()
        self._reader = self._writer = None


async def closed_loop(
    host: str,
    port: int,
    path: str,
    bodies: Sequence[bytes],
    concurrency: int,
    on_response: Callable[[int, bytes], None] | None = None,
) -> LoadResult:
    """``concurrency`` clients, each sending its next body as soon as its last returns.

    Args:
        host: server address.
        port: server port.
        path: request path.
        bodies: one request body per request; their count bounds the run.
        concurrency: clients in flight.
        on_response: called with each response's status and body.
    """
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    next_index = iter(range(len(bodies)))

    async def client() -> None:
        conn = Connection(host, port)
        try:
            for i in next_index:
                started = time.perf_counter()
                try:
                    status, payload = await conn.post(path, bodies[i])
                except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                    status, payload = 0, b""
                    await conn.close()
                latencies.append(time.perf_counter() - started)
                statuses[status] = statuses.get(status, 0) + 1
                if on_response is not None:
                    on_response(status, payload)
        finally:
            await conn.close()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    errors = sum(n for status, n in statuses.items() if status != 200)
    return LoadResult(len(bodies), errors, seconds, latencies, statuses)
