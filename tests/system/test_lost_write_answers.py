"""Adversarial tests of writes whose answer is lost (issue 23, break 6): the write ran on
Redis, the gateway never heard so. Real redis-server, a real TCP path that loses answers,
real gateway and worker; every request is counted: sent, answered, ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlparse

import httpx
import redis.asyncio as aioredis

from conveyor.embedded import free_port
from tests.helpers import Doubler, Harness, number_stage, until


class LinkCut:
    """A TCP proxy to a Redis whose link can be cut right after a write reaches Redis:
    the write runs, its answer never arrives, and nothing more passes (each connection is
    closed as data comes, each new one at once) until :meth:`heal`, as when the link to a
    node drops, or a node is killed after applying a write and comes back.

    Args:
        upstream: the Redis port it forwards to.
    """

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.cut = False
        self._armed = False
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    def cut_after_next_xadd(self) -> None:
        """Cut the link once the next XADD has been passed to Redis."""
        self._armed = True

    def heal(self) -> None:
        """Let everything pass again (connections cut stay closed)."""
        self.cut = self._armed = False

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[LinkCut]:
        """Listen on :attr:`port` while inside."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        try:
            yield self
        finally:
            self._server.close()
            for task in self._pipes:
                task.cancel()
            await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        try:
            if self.cut:
                return
            redis_r, redis_w = await asyncio.open_connection("127.0.0.1", self.upstream)
            try:
                up = asyncio.create_task(self._pump(client_r, redis_w, upward=True))
                down = asyncio.create_task(self._pump(redis_r, client_w, upward=False))
                await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
                for pump in (up, down):
                    pump.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
            finally:
                redis_w.close()
        finally:
            client_w.close()
            self._pipes.discard(task)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, upward: bool
    ) -> None:
        """Copy ``source`` to ``sink`` until either closes or the link is cut."""
        while data := await source.read(65536):
            if self.cut:
                return  # dropped, and the connection with it
            sink.write(data)
            await sink.drain()
            if upward and self._armed and b"XADD" in data.upper():
                self.cut, self._armed = True, False


async def test_a_request_answered_503_never_runs_to_the_end(
    own_redis: Any, harness: Harness, redis: aioredis.Redis
) -> None:
    # BREAK (issue 23, break 6): README errors table, 503: "nothing takes effect". A write
    # that ran but whose answer was lost (on a cluster: a node killed after applying it, or
    # a connection closed under it) made the gateway answer 503 and withdraw the request in
    # the background; the withdrawal only landed once Redis answered again, and a worker
    # that read the entry first ran it to the end: one answered 503 counted "ok" (one per
    # node-kill run, two runs). Trigger: the gateway's link to Redis is cut right after its
    # XADD reaches Redis (a proxy), while a worker, connected directly, runs the request;
    # the link comes back once it has, within the write's time.
    # Expected: the gateway settles the withdrawal before it answers: 503 only when the
    # request was withdrawn first (nothing of it runs), its result when it ran. Counted:
    # sent, answered by status, and run ("ok" in the stage's counters): none answered 503
    # ran, and every 200 ran once.
    url = urlparse(os.environ["CONVEYOR_REDIS_URL"])
    assert url.port is not None
    stage = number_stage(batch_wait_ms=0)
    worker = harness.worker(stage, Doubler())
    await worker.start()
    harness.run(worker)
    async with LinkCut(url.port).running() as proxy:
        http = await harness.gateway(
            [stage],
            redis_url=f"redis://127.0.0.1:{proxy.port}/0",
            redis_timeout_s=1.0,
            admission_refresh_ms=600_000,
        )
        warm = await http.post("/v1/double", json={"value": 0})
        assert warm.status_code == 200, warm.text
        sent = 6
        answers: list[httpx.Response] = []
        for v in range(1, sent + 1):
            before = (await harness.stats("double")).get("items:ok", 0)
            proxy.cut_after_next_xadd()
            call = asyncio.create_task(http.post("/v1/double", json={"value": v}))

            async def ran(before: int = before) -> bool:
                return (await harness.stats("double")).get("items:ok", 0) > before

            try:
                await until(ran, limit_s=10)  # the worker ran it: the write had landed
            finally:
                proxy.heal()
            answers.append(await call)
        statuses = [r.status_code for r in answers]
        assert set(statuses) <= {200, 503}, [r.text for r in answers]
        for v, r in enumerate(answers, start=1):
            if r.status_code == 200:
                assert r.json() == {"value": 2 * v}
        stats = await harness.stats("double")
        # Every request sent ran (the test waited for it): none may have been answered 503.
        assert stats.get("items:ok", 0) == 1 + sent, stats
        assert statuses == [200] * sent, [r.text for r in answers]
