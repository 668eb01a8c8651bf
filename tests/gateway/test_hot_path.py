"""The hot path (gateway/fastpath.py) and the shared enqueue round trip (gateway/enqueue.py):
the hot path answers what it takes exactly as the FastAPI route would, and hands it the
rest; concurrent enqueues share one round trip, and a round trip that fails fails every
request in it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI
from redis.exceptions import OutOfMemoryError, ResponseError

from conveyor.embedded import free_port
from gateway.app import create_app
from gateway.enqueue import Enqueuer
from gateway.fastpath import SyncCalls
from gateway.settings import GatewaySettings
from pipelines.envelope import decode_request, encode
from pipelines.graph import single
from pipelines.keys import Keys
from pipelines.registry import Registry
from runtime.redisio import REDIS_DOWN
from tests.helpers import Doubler, Harness, number_stage, until

PLAIN = {"Content-Type": "application/json"}
ROUTE = {"Content-Type": "application/vnd.test+json"}  # JSON to FastAPI, not to the hot path

# (body, extra headers, whether the hot path takes it)
CASES: list[tuple[bytes, dict[str, str], bool]] = [
    (b'{"value": 3}', {}, True),
    (b'{"value": 3.0}', {}, True),
    (b'{"value": 3, "fail": true}', {}, True),  # the worker fails it: 500
    (b'{"value": 3}', {"X-Conveyor-Timeout": "5"}, True),
    (b'{"value": 3}', {"X-Conveyor-Timeout": "0.5e1"}, False),
    (b'{"value": 3}', {"X-Conveyor-Timeout": "0"}, False),
    (b'{"value": 3}', {"X-Conveyor-Timeout": "inf"}, False),
    (b'{"value": 3}', {"X-Trace-Id": "t" * 128}, True),
    (b'{"value": 3}', {"X-Trace-Id": "t" * 129}, False),
    (b'{"value": 3}', {"X-Conveyor-Priority": "bulk"}, True),
    (b'{"value": 3}', {"X-Conveyor-Priority": "Bulk"}, False),
    (b'{"value": "x"}', {}, False),
    (b'{"value": 1, "extra": 2}', {}, False),
    (b"{}", {}, False),
    (b"[]", {}, False),
    (b"null", {}, False),
    (b"", {}, False),
    (b"{not json", {}, False),
    (b'{"value": NaN}', {}, False),
    (b'{"value": 1e400}', {}, False),
    (b'{"value": 1, "fail": "\\ud800"}', {}, False),
    (b"[" * 100 + b"]" * 100, {}, False),
]


@contextlib.asynccontextmanager
async def started(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client on ``app`` in this process, its lifespan entered and answering."""
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http,
    ):
        await http.get("/healthz")
        yield http


def hot_path(app: FastAPI) -> SyncCalls:
    """The app's :class:`SyncCalls` (its middleware stack is built by the first request)."""
    layer: Any = app.middleware_stack
    while not isinstance(layer, SyncCalls):
        layer = layer.app
    return layer


async def both_ways(
    http: httpx.AsyncClient,
    calls: SyncCalls,
    path: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
) -> tuple[httpx.Response, httpx.Response, bool]:
    """``body`` posted to ``path`` as plain JSON, for the hot path to take, then as JSON
    the hot path leaves to the route (which it must): both answers, and whether the hot
    path took the first."""
    extra = dict(headers or {})
    before = calls.answered
    hot = await http.post(path, content=body, headers={**PLAIN, **extra})
    took = calls.answered - before
    route = await http.post(path, content=body, headers={**ROUTE, **extra})
    assert calls.answered == before + took, (path, body, extra, route.text)
    assert took in (0, 1), took
    return hot, route, bool(took)


def seen(resp: httpx.Response) -> tuple[int, Any, set[str]]:
    """What a client sees, less the request's own id."""
    try:
        body = resp.json()
    except ValueError:
        body = resp.text
    if isinstance(body, dict):
        body.pop("request_id", None)
    headers = {h for h in resp.headers if h in {"x-request-id", "retry-after", "content-type"}}
    return resp.status_code, body, headers


async def test_the_hot_path_answers_as_the_route_does(harness: Harness) -> None:
    stage = number_stage(batch_wait_ms=0)
    worker = harness.worker(stage, Doubler())
    await worker.start()
    harness.run(worker)
    app = create_app(GatewaySettings(reply_block_ms=100), Registry([single(stage)]))
    async with started(app) as http:
        calls = hot_path(app)
        for body, headers, plain in CASES:
            hot, route, took = await both_ways(http, calls, "/v1/double", body, headers)
            assert took == plain, (body, headers)
            assert seen(hot) == seen(route), (body, headers, hot.text, route.text)
        # A header sent twice is the route's to read.
        before = calls.answered
        twice = [("X-Conveyor-Timeout", "5"), ("X-Conveyor-Timeout", "6"), *PLAIN.items()]
        resp = await http.post("/v1/double", content=b'{"value": 4}', headers=twice)
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"value": 8}
        assert calls.answered == before


class Counting(aioredis.Connection):
    """A connection that counts what it sends (one count per write to the socket)."""

    sends = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        Counting.sends += 1
        await super().send_packed_command(command, check_health)


async def test_concurrent_enqueues_share_one_round_trip(
    harness: Harness, redis_url: str, namespace: str
) -> None:
    pool = aioredis.ConnectionPool.from_url(redis_url, connection_class=Counting)
    client = aioredis.Redis.from_pool(pool)
    try:
        await client.ping()  # connected (its handshake counted before the work)
        enqueuer = Enqueuer(client, Keys(namespace), write_s=10)
        requests = [harness.request("p", "double", "double", {"value": i}) for i in range(64)]
        Counting.sends = 0
        await asyncio.gather(*(enqueuer.enqueue(r) for r in requests))
        assert Counting.sends == 1
        assert await client.xlen(Keys(namespace).stage_stream("double")) == 64
        # One alone is one plain XADD.
        Counting.sends = 0
        await enqueuer.enqueue(harness.request("p", "double", "double", {"value": 64}))
        assert Counting.sends == 1
        assert await client.xlen(Keys(namespace).stage_stream("double")) == 65
    finally:
        await client.aclose()


async def test_a_burst_reaches_a_blocked_reader_whole(
    harness: Harness, redis: aioredis.Redis, namespace: str
) -> None:
    # Issue 37: a worker waiting in XREADGROUP BLOCK was served by Redis right after the
    # first XADD of a gateway's pipelined burst: it read one entry, then came back for
    # the rest (a round trip and a read more per batch). The burst's XADDs are one
    # MULTI/EXEC now: Redis serves the blocked read once they are all in.
    keys = Keys(namespace)
    stream = keys.stage_stream("double")
    await redis.xgroup_create(stream, "g", id="0", mkstream=True)
    reader = aioredis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])
    try:
        await reader.ping()
        blocking: Any = reader.xreadgroup("g", "c", {stream: ">"}, count=100, block=10_000)
        waiting = asyncio.ensure_future(blocking)

        async def blocked() -> bool:
            return int((await redis.info("clients"))["blocked_clients"]) >= 1

        await until(blocked, 10)
        enqueuer = Enqueuer(redis, keys, write_s=10)
        requests = [harness.request("p", "double", "double", {"value": i}) for i in range(8)]
        await asyncio.gather(*(enqueuer.enqueue(r) for r in requests))
        read: Any = await asyncio.wait_for(waiting, 10)
        assert len(read[0][1]) == 8  # 1 before
    finally:
        await reader.aclose()


async def test_a_burst_redis_refuses_for_memory_fails_each_caller_and_adds_nothing(
    own_redis: subprocess.Popen[bytes], harness: Harness, namespace: str
) -> None:
    # A burst is one MULTI/EXEC: Redis refusing its XADDs as they are queued (OOM under
    # noeviction) aborts the EXEC. Every caller is refused with Redis's own error, as
    # when each XADD was refused alone, and nothing is added; once memory frees, a burst
    # goes in.
    keys = Keys(namespace)
    client = aioredis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])
    try:
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", 1)
        enqueuer = Enqueuer(client, keys, write_s=10)
        requests = [harness.request("p", "double", "double", {"value": i}) for i in range(6)]
        outcomes = await asyncio.gather(
            *(enqueuer.enqueue(r) for r in requests), return_exceptions=True
        )
        assert all(isinstance(o, OutOfMemoryError) for o in outcomes), outcomes
        await client.config_set("maxmemory", 0)
        assert not await client.exists(keys.stage_stream("double"))
        await asyncio.gather(*(enqueuer.enqueue(r) for r in requests))
        assert await client.xlen(keys.stage_stream("double")) == 6
    finally:
        await client.config_set("maxmemory", 0)
        await client.aclose()


async def test_an_xadd_redis_refuses_fails_only_its_own_request(
    harness: Harness, redis: aioredis.Redis, namespace: str
) -> None:
    keys = Keys(namespace)
    await redis.set(keys.stage_stream("broken"), "not a stream")
    enqueuer = Enqueuer(redis, keys, write_s=10)
    good = [harness.request("p", "double", "double", {"value": i}) for i in range(5)]
    bad = harness.request("p", "broken", "broken", {"value": 0})
    outcomes = await asyncio.gather(
        *(enqueuer.enqueue(r) for r in [*good[:2], bad, *good[2:]]), return_exceptions=True
    )
    assert isinstance(outcomes[2], ResponseError)
    assert "WRONGTYPE" in str(outcomes[2])
    assert [o for i, o in enumerate(outcomes) if i != 2] == [None] * 5
    assert await redis.xlen(keys.stage_stream("double")) == 5
    assert await redis.get(keys.stage_stream("broken")) == b"not a stream"


async def test_a_burst_reaches_each_stream_it_names_in_order(
    harness: Harness, redis: aioredis.Redis, namespace: str
) -> None:
    # One call, several streams (stages, lanes): each entry on its own, whole, in order.
    keys = Keys(namespace)
    enqueuer = Enqueuer(redis, keys, write_s=10)
    burst = [
        harness.request("p", stage, stage, {"value": i}, lane=lane)
        for i, (stage, lane) in enumerate(
            [("a", "interactive"), ("b", "interactive"), ("a", "bulk"), ("a", "interactive")]
        )
    ]
    await asyncio.gather(*(enqueuer.enqueue(r) for r in burst))
    for stage, lane, values in [("a", "interactive", [0, 3]), ("b", "interactive", [1])]:
        entries: Any = await redis.xrange(keys.stage_stream(stage, lane))
        assert [decode_request(f).payload["value"] for _, f in entries] == values
        assert all(set(f) == set(encode(burst[0])) for _, f in entries)
    assert await redis.xlen(keys.stage_stream("a", "bulk")) == 1


async def test_a_round_trip_that_fails_fails_every_request_in_it(
    harness: Harness, namespace: str
) -> None:
    dead = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1)
    try:
        enqueuer = Enqueuer(dead, Keys(namespace), write_s=10)
        requests = [harness.request("p", "double", "double", {"value": i}) for i in range(20)]
        async with asyncio.timeout(30):
            outcomes = await asyncio.gather(
                *(enqueuer.enqueue(r) for r in requests), return_exceptions=True
            )
        assert all(isinstance(o, REDIS_DOWN) for o in outcomes), outcomes
    finally:
        await dead.aclose()


async def test_a_caller_gone_before_its_round_trip_is_not_sent_and_others_are(
    harness: Harness, redis: aioredis.Redis, namespace: str
) -> None:
    enqueuer = Enqueuer(redis, Keys(namespace), write_s=10)
    first = asyncio.create_task(
        enqueuer.enqueue(harness.request("p", "double", "double", {"value": 1}))
    )
    joined = asyncio.create_task(
        enqueuer.enqueue(harness.request("p", "double", "double", {"value": 2}))
    )
    await asyncio.sleep(0)  # both wait for the round trip the first started
    first.cancel()  # its client went away: only its own wait ends
    await joined
    with pytest.raises(asyncio.CancelledError):
        await first
    stream = Keys(namespace).stage_stream("double")
    assert await redis.xlen(stream) == 1  # the second's only
    await enqueuer.enqueue(harness.request("p", "double", "double", {"value": 3}))
    assert await redis.xlen(stream) == 2


async def test_a_round_trip_stopped_midway_fails_those_in_it(
    harness: Harness, redis: aioredis.Redis, namespace: str
) -> None:
    enqueuer = Enqueuer(redis, Keys(namespace), write_s=10)
    callers = [
        asyncio.create_task(
            enqueuer.enqueue(harness.request("p", "double", "double", {"value": v}))
        )
        for v in (1, 2)
    ]
    await asyncio.sleep(0)  # both joined the round trip the first started
    for lead in list(enqueuer._leading):  # the process stopping cancels it
        lead.cancel()
    for caller in callers:
        with pytest.raises(REDIS_DOWN):
            await caller
    # Nothing was sent; the next enqueue starts a round trip of its own.
    await enqueuer.enqueue(harness.request("p", "double", "double", {"value": 3}))
    assert await redis.xlen(Keys(namespace).stage_stream("double")) == 1


@contextlib.asynccontextmanager
async def stalled(
    own_redis: subprocess.Popen[bytes], namespace: str, write_s: float
) -> AsyncIterator[Enqueuer]:
    """An enqueuer whose client connected before its Redis was stopped (SIGSTOP): an XADD
    is sent and never answered. On the way out Redis resumes and the round trips under way
    are cancelled."""
    client = aioredis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])
    await client.ping()
    enqueuer = Enqueuer(client, Keys(namespace), write_s=write_s)
    own_redis.send_signal(signal.SIGSTOP)
    try:
        yield enqueuer
    finally:
        own_redis.send_signal(signal.SIGCONT)
        for lead in list(enqueuer._leading):
            lead.cancel()
        await asyncio.gather(*enqueuer._leading, return_exceptions=True)
        await client.aclose()


async def test_each_caller_of_a_stalled_round_trip_times_out_at_its_own_deadline(
    harness: Harness, own_redis: subprocess.Popen[bytes], namespace: str
) -> None:
    async with stalled(own_redis, namespace, write_s=30) as enqueuer:
        soon, later = (
            asyncio.create_task(
                enqueuer.enqueue(
                    harness.request("p", "double", "double", {"value": 1}, deadline=time.time() + s)
                )
            )
            for s in (0.3, 1.0)
        )
        with pytest.raises(TimeoutError):
            await soon
        assert not later.done()  # its own deadline is later: still waiting
        with pytest.raises(TimeoutError):
            await later
