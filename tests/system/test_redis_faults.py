"""Redis-side faults on real processes and a real redis-server of the test's own: Redis
killed and restarted from its AOF, a worker paused mid-batch, a gateway killed, a gateway
out of pooled connections, clients that give up.

Waiting is on conditions, each bounded; nothing sleeps and hopes, and no test asserts a
speed: "promptly" is proven by making the slow path (the reclaim) impossible.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from conveyor.embedded import free_port, start_redis
from pipelines.envelope import decode_replies
from pipelines.keys import GROUP, LANES, Lane
from runtime.redisio import text
from runtime.status import stage_status
from tests.helpers import Doubler, Harness, number_stage, replies_in, until, wait_ready
from tests.support.faultapp import SLOW, TEXTS, SlowTexts, spawn, stop


class Server:
    """A redis-server of one test, persisting every write (AOF, ``appendfsync always``).

    Args:
        workdir: where its AOF lives (kept across restarts).
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = start_redis(self.port, workdir, appendonly=True)

    def kill(self) -> None:
        """SIGKILL: no shutdown save, only what the AOF holds survives."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def restart(self) -> None:
        """Start it again on the same port, loading its AOF."""
        self.proc = start_redis(self.port, self.workdir, appendonly=True)

    def stop(self) -> None:
        """Stop it for good."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture
def server(env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """The test's own Redis; every process the test starts afterwards is pointed at it.
    (Requested before ``harness``, so the harness's client connects here too.)"""
    srv = Server(tmp_path / "redis")
    monkeypatch.setenv("CONVEYOR_REDIS_URL", srv.url)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
async def admin(server: Server) -> AsyncIterator[aioredis.Redis]:
    """A plain client on the test's Redis, outside every pool under test."""
    client = aioredis.Redis.from_url(server.url)
    try:
        yield client
    finally:
        await client.aclose()


def slow_worker(workdir: Path, **env: str) -> subprocess.Popen[bytes]:
    """A real worker of the ``slow`` stage, logging to ``workdir``/worker.log."""
    return spawn("workers", "slow", log=workdir / "worker.log", **env)


async def test_a_pool_wait_timeout_is_overload_not_an_outage(
    server: Server, harness: Harness, admin: aioredis.Redis
) -> None:
    # Two pooled connections, both held by writes Redis is holding (CLIENT PAUSE WRITE):
    # the other requests wait for a connection, not for Redis, and are told so.
    http = await harness.gateway(
        [number_stage(batch_wait_ms=0)], redis_max_connections=2, redis_timeout_s=0.5
    )
    # The server fsyncs every write: on a loaded machine one may outlast the 0.5 s timeout,
    # so the gateway is first shown to serve, and at the end to serve again, with retries.
    await until(lambda: _accepted(http, 0))
    await admin.client_pause(30_000, all=False)  # lifted below, however long the calls take
    try:
        calls = [http.post("/v1/jobs/double", json={"value": v}, timeout=30) for v in range(8)]
        got = await asyncio.gather(*calls)
    finally:
        await admin.client_unpause()
    details = [r.json()["detail"] for r in got]
    assert {r.status_code for r in got} == {503}, details
    saturated = [r for r in got if "saturated" in r.json()["detail"]]
    assert saturated, details  # all said "the queue is unreachable" before
    for r in saturated:
        assert r.json()["detail"].startswith("the gateway is saturated: no free Redis connection")
        assert r.headers["Retry-After"] == "1"
    # Redis itself was fine all along, and once the writes go through, so do requests.
    await until(lambda: _accepted(http, 1))


async def _accepted(http: httpx.AsyncClient, value: int) -> bool:
    return (await http.post("/v1/jobs/double", json={"value": value})).status_code == 202


async def answered(redis: aioredis.Redis, stream: str) -> int:
    return await replies_in(redis, stream)


async def reply_ids(redis: aioredis.Redis, stream: str) -> list[str]:
    return [one.id for _, f in await redis.xrange(stream) or [] for one in decode_replies(f or {})]


async def test_first_publish_after_a_redis_restart_needs_no_reclaim(
    server: Server, harness: Harness, tmp_path: Path
) -> None:
    # A batch whose publish failed would be answered only by a reclaim, ten minutes away.
    worker = slow_worker(
        tmp_path,
        CONVEYOR_TEST_DELAY_S="0.02",
        CONVEYOR_MAX_BATCH_SIZE="4",
        CONVEYOR_BLOCK_MS="100",
        CONVEYOR_MIN_IDLE_MS="600000",
    )
    reply_stream = harness.keys.reply_stream("test")
    try:
        # Load first: two batches in flight leave several connections in the worker's pool.
        await harness.enqueue("slow", [{"value": i} for i in range(40)])
        await until(lambda: _at_least(harness.redis, reply_stream, 40))
        server.kill()
        server.restart()  # the stage is idle; its pooled connections are dead
        fresh = aioredis.Redis.from_url(server.url)
        try:
            harness.redis = fresh
            sent = await harness.enqueue("slow", [{"value": 1000}])
            await until(lambda: _at_least(fresh, reply_stream, 41))
            got = await reply_ids(fresh, reply_stream)
            assert got.count(sent[0].id) == 1
        finally:
            await fresh.aclose()
    finally:
        stop(worker)


async def test_first_requests_after_a_redis_restart_are_not_refused(
    server: Server, harness: Harness
) -> None:
    # Every connection of the gateway's pool died with the server; each used to fail its
    # next command, so the first requests after a restart got 503 "unreachable".
    http = await harness.gateway([number_stage(batch_wait_ms=0)], redis_max_connections=4)
    posts = (http.post("/v1/jobs/double", json={"value": v}) for v in range(8))
    first = await asyncio.gather(*posts)
    assert {r.status_code for r in first} == {202}
    server.kill()
    server.restart()
    after = [await http.post("/v1/jobs/double", json={"value": v}) for v in range(4)]
    assert [r.status_code for r in after] == [202] * 4, [r.text for r in after]
    polled = await http.get(after[0].headers["location"])
    assert polled.json()["status"] == "queued"


async def _at_least(redis: aioredis.Redis, stream: str, n: int) -> bool:
    return await answered(redis, stream) >= n


@pytest.mark.parametrize("lane", LANES)
async def test_paused_worker_resumed_doubles_no_reply_and_no_count(
    harness: Harness, redis: aioredis.Redis, tmp_path: Path, lane: Lane
) -> None:
    # On either lane: a bulk batch paused mid-run is reclaimed from its lane's stream too.
    sent = await harness.enqueue("slow", [{"value": i} for i in range(32)], lane=lane)
    paused = slow_worker(tmp_path, CONVEYOR_TEST_DELAY_S="4", CONVEYOR_BLOCK_MS="100")
    stream = harness.keys.stage_stream("slow", lane)
    reply_stream = harness.keys.reply_stream("test")
    try:

        async def holding_all() -> bool:
            return (await stage_status(redis, harness.keys, "slow")).pending == 32

        await until(holding_all)
        paused.send_signal(signal.SIGSTOP)  # mid-batch: its heartbeat stops too
        survivor = harness.worker(SLOW, Doubler(), min_idle_ms=300, reclaim_interval_ms=50)
        harness.run(survivor)
        await until(lambda: _at_least(redis, reply_stream, 32))
        paused.send_signal(signal.SIGCONT)  # it finishes its batch and publishes it

        async def both_ran() -> bool:  # the survivor's run of the 32, and the paused one's
            return (await harness.stats("slow")).get("model_items", 0) >= 64

        await until(both_ran)
    finally:
        stop(paused)
    got = await reply_ids(redis, reply_stream)
    assert sorted(got) == sorted(r.id for r in sent)  # none lost, none doubled
    stats = await harness.stats("slow")
    items = {k: v for k, v in stats.items() if k.startswith("items:")}
    assert items == {"items:ok": 32}  # 64 before: the resumed batch was counted too
    assert stats["model_items"] == 64  # the duplicated work is visible
    assert (await redis.xpending(stream, GROUP))["pending"] == 0


async def test_a_worker_killed_between_the_batches_of_a_length_aware_window_loses_none(
    harness: Harness, redis: aioredis.Redis, tmp_path: Path
) -> None:
    # One window of short and long texts runs as two batches, back to back; the worker
    # dies after publishing the first, while the second runs: its entries, still pending,
    # are reclaimed and answered once, and the first batch's are not run again.
    texts = [f"s{i}" for i in range(8)] + [" ".join(["long"] * 300) + str(i) for i in range(8)]
    sent = await harness.enqueue("texts", [{"text": t} for t in texts])
    victim = spawn(
        "workers",
        "texts",
        log=tmp_path / "worker.log",
        CONVEYOR_TEST_DELAY_S="1.5",
        CONVEYOR_BLOCK_MS="100",
    )
    reply_stream = harness.keys.reply_stream("test")
    try:
        await until(lambda: _at_least(redis, reply_stream, 8), limit_s=60)  # the short ones
        victim.kill()  # the long ones' batch is running
        victim.wait(timeout=10)
        assert await answered(redis, reply_stream) == 8
        survivor = harness.worker(TEXTS, SlowTexts(), min_idle_ms=300, reclaim_interval_ms=50)
        harness.run(survivor)
        await until(lambda: _at_least(redis, reply_stream, 16))
    finally:
        stop(victim)
    replies = [
        one for _, f in await redis.xrange(reply_stream) or [] for one in decode_replies(f or {})
    ]
    assert sorted(r.id for r in replies) == sorted(r.id for r in sent)  # none lost or doubled
    by_id = {r.id: r.result for r in replies}
    assert [by_id[r.id] for r in sent] == [{"n": len(t)} for t in texts]
    first = [r.id for r in replies[:8]]
    assert sorted(first) == sorted(r.id for r in sent[:8])  # the short batch went first
    stats = await harness.stats("texts")
    assert stats["items:ok"] == 16
    assert stats["model_items"] == 16  # counted as published: the dead worker's run is not
    assert (await stage_status(redis, harness.keys, "texts")).pending == 0


async def test_redis_kill_9_under_job_load_completes_every_job_and_admits_again(
    server: Server, harness: Harness, tmp_path: Path
) -> None:
    worker = slow_worker(
        tmp_path,
        CONVEYOR_TEST_DELAY_S="0.01",
        CONVEYOR_BLOCK_MS="100",
        CONVEYOR_MIN_IDLE_MS="1000",
        CONVEYOR_RECLAIM_INTERVAL_MS="200",
        CONVEYOR_TRIM_INTERVAL_S="0.5",
    )
    http = await harness.gateway([SLOW], redis_timeout_s=0.5)
    accepted: list[tuple[int, str]] = []
    refused: list[str] = []
    done_loading = asyncio.Event()

    async def load(first: int) -> None:
        v = first
        while not done_loading.is_set():
            resp = await http.post("/v1/jobs/slow", json={"value": v})
            if resp.status_code == 202:
                accepted.append((v, resp.json()["id"]))
            else:
                assert resp.status_code == 503, resp.text
                refused.append(resp.json()["detail"])
                await asyncio.sleep(0.01)  # pacing while Redis is down, not a wait
            v += 4

    answered: list[tuple[int, int]] = []  # sync calls (interactive lane): value, doubled

    async def call(first: int) -> None:
        # Interactive calls beside the bulk jobs: the lanes survive the restart together.
        v = first
        while not done_loading.is_set():
            resp = await http.post("/v1/slow", json={"value": v}, headers=deadline)
            if resp.status_code == 200:
                answered.append((v, resp.json()["value"]))
            else:  # refused while Redis was down, or its reply lost with it
                assert resp.status_code in (503, 504), resp.text
                await asyncio.sleep(0.01)  # pacing while Redis is down, not a wait
            v += 4

    async def accepted_at_least(n: int) -> bool:
        return len(accepted) >= n

    # The most jobs the bulk lane really held undelivered or unacknowledged, read from the
    # stream itself (its entries past the group's cursor, and its pending ones) while the
    # load runs: a slow machine restarts the worker late, and meanwhile the backlog is real.
    deepest = [0]
    watcher = aioredis.Redis.from_url(server.url)
    bulk = harness.keys.stage_stream("slow", "bulk")

    async def watch_backlog() -> None:
        while not done_loading.is_set():
            with contextlib.suppress(RedisError, OSError):
                group = next(
                    (g for g in await watcher.xinfo_groups(bulk) if text(g["name"]) == GROUP),
                    None,
                )
                if group is not None:
                    last = text(group["last-delivered-id"])
                    past = await watcher.xrange(bulk, min=f"({last}", max="+", count=4096)
                    deepest[0] = max(deepest[0], len(past or []) + int(group["pending"]))
            await asyncio.sleep(0.02)  # a sampling period, not a wait for an event

    async def answered_at_least(n: int) -> bool:
        return len(answered) >= n

    deadline = {"X-Conveyor-Timeout": "3"}
    loaders = [asyncio.create_task(load(i)) for i in range(4)]
    loaders += [asyncio.create_task(call(1000 + i)) for i in range(2)]
    loaders.append(asyncio.create_task(watch_backlog()))
    try:
        await until(lambda: accepted_at_least(100))
        server.kill()
        server.restart()
        before, calls = len(accepted), len(answered)
        await until(lambda: accepted_at_least(before + 100), limit_s=30)  # admits again
        await until(lambda: answered_at_least(calls + 20), limit_s=30)  # and answers calls
    finally:
        done_loading.set()
        await asyncio.gather(*loaders)
        await watcher.aclose()
    assert all(doubled == 2 * v for v, doubled in answered)
    fresh = aioredis.Redis.from_url(server.url)
    try:

        async def all_done() -> bool:
            pipe = fresh.pipeline(transaction=False)
            for _, job_id in accepted:
                pipe.hget(harness.keys.job(job_id), "status")
            return all(s == b"done" for s in await pipe.execute())

        await until(all_done)
        for v, job_id in accepted[:: max(1, len(accepted) // 20)]:
            result = await fresh.hget(harness.keys.job(job_id), "result")
            assert result == f'{{"value":{2 * v}}}'.encode()
        # Never refused on a stale lag: a refusal at the bound is one the stream bore out
        # (the bulk lane really held near the bound, less what its batches and the
        # sampling period can take meanwhile).
        if [r for r in refused if "capacity" in r]:
            assert deepest[0] >= SLOW.max_backlog - 256, (deepest[0], refused[-1])
        status = await stage_status(fresh, harness.keys, "slow")
        assert 0 <= status.lag <= status.length
        assert (await http.post("/v1/jobs/slow", json={"value": 0})).status_code == 202
    finally:
        await fresh.aclose()
        stop(worker)


LONG_LIVED = ("stage", "stats", "stages", "dlq", "partitions", "definition", "definition-holders")
"""Key kinds ({ns}:<kind>:...) that live as long as the deployment; everything else expires."""


async def test_gateway_kill_9_under_load_completes_jobs_and_orphans_no_key(
    harness: Harness, redis: aioredis.Redis, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "gateway.log"
    gateway = spawn("gateway", log=log, CONVEYOR_PORT=str(port), CONVEYOR_REPLY_BLOCK_MS="100")
    worker = slow_worker(tmp_path, CONVEYOR_TEST_DELAY_S="0.02", CONVEYOR_BLOCK_MS="100")
    base = f"http://127.0.0.1:{port}"
    accepted: list[str] = []
    try:
        await asyncio.to_thread(wait_ready, base, {"gateway": gateway}, lambda _: log.read_text())
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:

            async def load(job: bool) -> None:
                v = 0
                while True:
                    try:
                        if job:
                            resp = await http.post("/v1/jobs/slow", json={"value": v})
                            if resp.status_code == 202:
                                accepted.append(resp.json()["id"])
                        else:
                            await http.post("/v1/slow", json={"value": v})
                    except httpx.TransportError:
                        return  # the gateway is gone
                    v += 1

            loaders = [asyncio.create_task(load(i % 2 == 0)) for i in range(8)]

            async def loaded() -> bool:
                return len(accepted) >= 50

            await until(loaded)
            gateway.kill()
            gateway.wait(timeout=10)
            await asyncio.gather(*loaders)

        async def all_done() -> bool:
            pipe = redis.pipeline(transaction=False)
            for job_id in accepted:
                pipe.hget(harness.keys.job(job_id), "status")
            return all(s == b"done" for s in await pipe.execute())

        async def drained() -> bool:
            status = await stage_status(redis, harness.keys, "slow")
            return status.lag == 0 and status.pending == 0

        await until(all_done)
        await until(drained)
    finally:
        stop(gateway)
        stop(worker)
    orphans = []
    async for key in redis.scan_iter(match=f"{harness.keys.prefix}:*", count=1000):
        kind = text(key)[len(harness.keys.prefix) + 1 :].split(":", 1)[0]
        if kind not in LONG_LIVED and await redis.ttl(key) < 0:
            orphans.append(text(key))
    assert orphans == []


async def test_requests_their_clients_gave_up_on_are_not_run(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage(max_batch_size=1, batch_wait_ms=0)
    worker = harness.worker(stage, Doubler(delay_s=0.5))
    await worker.start()
    harness.run(worker)
    base = await harness.http_server([stage])
    async with httpx.AsyncClient(base_url=base) as http:

        async def give_up(v: int) -> None:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/double", json={"value": v}, timeout=0.2)

        await asyncio.gather(*(give_up(v) for v in range(8)))

    async def settled() -> bool:  # every entry delivered and acknowledged, run or not
        status = await stage_status(redis, harness.keys, "double")
        return status.lag == 0 and status.pending == 0

    await until(settled)
    # At most the one already in the model when its client left; today all 8 run.
    assert (await harness.stats("double")).get("model_items", 0) <= 1
