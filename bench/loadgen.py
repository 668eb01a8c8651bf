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
        requests: requests sent (fewer than the bodies when the duration ran out).
        errors: responses other than the success status (and connection failures).
        seconds: wall time of the run.
        latencies: per request, seconds.
        statuses: count per status code.
        steady_ok: successful responses while every client was still busy.
        steady_seconds: how long every client was busy: from the start until the first
            client found no more work (bodies used up, or the duration over).
    """

    requests: int
    errors: int
    seconds: float
    latencies: list[float]
    statuses: dict[int, int] = field(default_factory=dict)
    steady_ok: int = 0
    steady_seconds: float = 0.0

    @property
    def throughput(self) -> float:
        """Successful requests per second, over the steady part of the run when known.

        As a closed loop winds down, fewer and fewer clients are in flight; counting that
        tail would understate a slow system by up to one latency over the run.
        """
        if self.steady_seconds > 0 and self.steady_ok > 0:
            return self.steady_ok / self.steady_seconds
        return (self.requests - self.errors) / self.seconds if self.seconds > 0 else 0.0

    def pct(self, q: float) -> float:
        """Latency quantile ``q`` (0..1) in milliseconds (NaN when nothing returned)."""
        if not self.latencies:
            return float("nan")
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

    async def post(self, path: str, body: bytes, headers: str = "") -> tuple[int, bytes]:
        """Send a JSON POST and return (status, body).

        Args:
            path: request path.
            body: JSON body.
            headers: extra header lines, each ending in CRLF.
        """
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{headers}\r\n"
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
    duration: float | None = None,
    warmup: float = 0.0,
    on_measure: Callable[[], object] | None = None,
    request_timeout: float = 60.0,
    ok: int = 200,
) -> LoadResult:
    """``concurrency`` clients, each sending its next body as soon as its last returns.

    With ``warmup``, the clients first load the server for that long without counting,
    then the measurement starts with every client already busy, as wrk does: the
    throughput counts what completes between the end of the warm-up and the moment the
    first client runs out of work, so neither the ramp-up nor the wind-down (fewer and
    fewer clients in flight) bends it.

    Args:
        host: server address.
        port: server port.
        path: request path.
        bodies: one request body per measured request; their count bounds the run.
        concurrency: clients in flight.
        on_response: called with each measured response's status and body.
        duration: also stop sending new requests this many seconds after the measurement
            starts (requests in flight then still complete and count).
        warmup: seconds of load before the measurement (bodies reused, nothing counted).
        on_measure: called in a thread as the measurement starts (e.g. to read counters).
        request_timeout: a request unanswered this long fails (status 0), so a lost reply
            cannot stall the run.
        ok: the status of a success (202 for a route that queues a job); any other is
            an error.
    """
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    ok_at: list[float] = []  # completion times of successful requests, warm-up included
    first_idle = [float("inf")]  # when the first client ran out of work
    next_index = iter(range(len(bodies)))
    warm_index = iter(range(1 << 62))
    started = time.perf_counter()
    measuring = started + warmup
    deadline = measuring + (float("inf") if duration is None else duration)

    async def post(conn: Connection, body: bytes) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(request_timeout):
                return await conn.post(path, body)
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError, TimeoutError):
            await conn.close()  # its state is unknown: the next request reconnects
            return 0, b""

    async def client() -> None:
        conn = Connection(host, port)
        try:
            while bodies and time.perf_counter() < measuring:
                status, _ = await post(conn, bodies[next(warm_index) % len(bodies)])
                if status == ok:
                    ok_at.append(time.perf_counter())  # counts if it lands in the window
            for i in next_index:
                if time.perf_counter() >= deadline:
                    break
                sent = time.perf_counter()
                status, payload = await post(conn, bodies[i])
                done = time.perf_counter()
                latencies.append(done - sent)
                statuses[status] = statuses.get(status, 0) + 1
                if status == ok:
                    ok_at.append(done)
                if on_response is not None:
                    on_response(status, payload)
            first_idle[0] = min(first_idle[0], time.perf_counter())
        finally:
            await conn.close()

    async def start_measuring() -> None:
        await asyncio.sleep(max(0.0, measuring - time.perf_counter()))
        if on_measure is not None:
            await asyncio.to_thread(on_measure)

    await asyncio.gather(start_measuring(), *(client() for _ in range(concurrency)))
    ended = time.perf_counter()
    errors = sum(n for status, n in statuses.items() if status != ok)
    window_end = min(first_idle[0], ended)
    steady_ok = sum(1 for t in ok_at if measuring <= t <= window_end)
    return LoadResult(
        len(latencies),
        errors,
        ended - measuring,
        latencies,
        statuses,
        steady_ok,
        max(0.0, window_end - measuring),
    )


async def open_loop(
    host: str, port: int, path: str, bodies: Sequence[bytes], rate: float, headers: str = ""
) -> list[tuple[int, float]]:
    """Send ``bodies`` at a fixed ``rate`` per second, whatever the answers (open loop), on
    a pool of keep-alive connections; returns (status, latency in seconds) per request.

    Args:
        host: server address.
        port: server port.
        path: request path.
        bodies: one body per request; their count bounds the run.
        rate: requests started per second.
        headers: extra header lines for every request, each ending in CRLF.
    """
    idle: list[Connection] = []
    out: list[tuple[int, float]] = []

    async def one(body: bytes) -> None:
        conn = idle.pop() if idle else Connection(host, port)
        started = time.perf_counter()
        try:
            status, _ = await conn.post(path, body, headers)
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            status = 0
            await conn.close()
        out.append((status, time.perf_counter() - started))
        idle.append(conn)

    began = time.perf_counter()
    tasks = []
    for i, body in enumerate(bodies):
        delay = began + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # the schedule is the point of an open loop
        tasks.append(asyncio.create_task(one(body)))
    await asyncio.gather(*tasks)
    for conn in idle:
        await conn.close()
    return out
