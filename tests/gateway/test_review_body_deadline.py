"""The body-read deadline on the shared alarm heap (gateway/edge.py) over real sockets:
clients that hang up mid-body, clients that stall mid-body and clients that send in time,
all at once, each get what they would alone; a deadline left behind by a request that is
over never cuts a later one short. Real Redis, real HTTP (uvicorn)."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx
import redis.asyncio as aioredis

from tests.gateway.test_edge import _exchange, serve_double
from tests.helpers import Harness, number_stage

HEAD = (
    b"POST /v1/double HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n"
)


async def _hang_up(base: str) -> None:
    """Send half a body, then close the connection."""
    url = urlsplit(base)
    _, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(HEAD + b'{"value": ')
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def test_hang_ups_stalls_and_prompt_clients_at_once(
    harness: Harness, redis: aioredis.Redis
) -> None:
    await serve_double(harness, delay_s=0.8)  # answers take longer than the deadline
    base = await harness.http_server([number_stage()], client_timeout_s=0.5)
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        prompt = [http.post("/v1/double", json={"value": v}) for v in range(5)]
        stalled = [_exchange(base, HEAD + b'{"value": ') for _ in range(5)]
        hung_up = [_hang_up(base) for _ in range(5)]
        replies, answers, _ = await asyncio.gather(
            asyncio.gather(*prompt), asyncio.gather(*stalled), asyncio.gather(*hung_up)
        )
        assert [r.status_code for r in replies] == [200] * 5
        assert [r.json() for r in replies] == [{"value": 2 * v} for v in range(5)]
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers
        # Nothing of the stalled or hung-up bodies was enqueued.
        assert await redis.xlen(harness.keys.stage_stream("double")) == 5
        # Past every deadline above, a prompt request that takes longer than the body
        # deadline is answered (no alarm of an earlier request cancels it).
        again = await http.post("/v1/double", json={"value": 7})
        assert again.status_code == 200, again.text
        assert again.json() == {"value": 14}
