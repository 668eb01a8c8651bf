"""Faults injected into real processes and a real Redis; each test counts the outcome.

Waiting here is on conditions (entries pending, replies arrived, a process exited),
each bounded; nothing sleeps and hopes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

from conveyor.embedded import free_port, start_redis
from pipelines.builtin import ADDER, builtin_pipelines
from pipelines.envelope import Request, decode_replies, encode
from pipelines.keys import GROUP
from pipelines.model import Item, Result
from pipelines.registry import Registry
from runtime.status import stage_status
from tests.helpers import Doubler, Harness, died_running, number_stage, replies_in, until
from tests.support.faultapp import CRASHY, SLOW, spawn
from workers.claims import trim
from workers.models.toy import Adder


async def replies(redis: aioredis.Redis, stream: str) -> list[dict[str, Any]]:
    return [
        one.model_dump()
        for _, f in await redis.xrange(stream) or []
        for one in decode_replies(f or {})
    ]


async def test_kill_9_mid_batch_loses_nothing_and_doubles_nothing(
    harness: Harness, redis: aioredis.Redis
) -> None:
    sent = await harness.enqueue("slow", [{"value": i} for i in range(32)])
    doomed = spawn("workers", "slow", CONVEYOR_TEST_DELAY_S="60")
    stream = harness.keys.stage_stream("slow")

    async def holding_all() -> bool:
        return (await stage_status(redis, harness.keys, "slow")).pending == 32

    try:
        await until(holding_all)  # the doomed worker has the whole batch in its model
    finally:
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=10)
    survivor = harness.worker(SLOW, Doubler(), min_idle_ms=300, reclaim_interval_ms=50)
    harness.run(survivor)
    reply_stream = harness.keys.reply_stream("test")

    async def all_answered() -> bool:
        return bool(await replies_in(redis, reply_stream) >= 32)

    await until(all_answered)
    got = await replies(redis, reply_stream)
    assert len(got) == 32  # none doubled
    assert sorted(r["id"] for r in got) == sorted(r.id for r in sent)  # none lost
    assert {r["outcome"] for r in got} == {"ok"}
    assert (await redis.xpending(stream, GROUP))["pending"] == 0


async def test_slow_batch_is_not_robbed_by_reclaim(harness: Harness, redis: aioredis.Redis) -> None:
    stage = number_stage(max_batch_size=8, batch_wait_ms=0)
    slow_model, thief_model = Doubler(delay_s=1.0), Doubler()
    slow = harness.worker(stage, slow_model, min_idle_ms=500)  # touches every ~167 ms
    thief = harness.worker(stage, thief_model, min_idle_ms=500, reclaim_interval_ms=20)
    await slow.start()
    await thief.start()
    sent = await harness.enqueue("double", [{"value": i} for i in range(4)])
    busy = harness.run(slow, max_batches=1)
    await asyncio.to_thread(slow_model.started.wait, 10)
    harness.run(thief)
    await busy  # 1 s of model time: twice the idle time that would trigger a reclaim
    thief.stop()
    assert thief_model.batches == []
    got = await replies(redis, harness.keys.reply_stream("test"))
    assert sorted(r["id"] for r in got) == sorted(r.id for r in sent)


async def test_poison_is_dead_lettered_while_good_requests_succeed(
    harness: Harness, redis: aioredis.Redis
) -> None:
    http = await harness.gateway([CRASHY])
    env = {
        "CONVEYOR_MIN_IDLE_MS": "300",
        "CONVEYOR_RECLAIM_INTERVAL_MS": "50",
        "CONVEYOR_MAX_DELIVERIES": "2",
        "CONVEYOR_BLOCK_MS": "100",
        # Suspects run in the worker, as where a fork is not safe (an accelerator): each
        # crash is a restart (in a child, tests/system/test_crash_isolation.py).
        "CONVEYOR_SUSPECTS_IN_CHILD": "false",
    }
    stopping = asyncio.Event()
    starts = 0

    async def supervise() -> None:  # restarts the worker whenever the poison kills it
        nonlocal starts
        while not stopping.is_set() and starts < 8:
            starts += 1
            proc = spawn("workers", "crashy", log=None, **env)
            exited = asyncio.create_task(asyncio.to_thread(proc.wait))
            stop = asyncio.create_task(stopping.wait())
            await asyncio.wait([exited, stop], return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not exited.done():
                proc.send_signal(signal.SIGTERM)
                await exited

    supervisor = asyncio.create_task(supervise())
    try:
        calls = [http.post("/v1/crashy", json={"value": v}, timeout=60) for v in [-1, *range(8)]]
        poison, *good = await asyncio.gather(*calls)
    finally:
        stopping.set()
        await supervisor
    assert [r.json() for r in good] == [{"value": 2 * v} for v in range(8)]
    assert poison.status_code == 500
    assert "dead-lettered after 3 deliveries" in poison.json()["detail"]
    dlq = await redis.xrange(harness.keys.dead_letters("crashy"))
    assert len(dlq or []) == 1
    assert starts >= 3  # crashed with its batch, crashed alone, then dead-lettered
    assert (await harness.stats("crashy"))["dead_letters"] == 1


class GatedAdder(Adder):
    """Adds one, but only after the test opens the gate."""

    def __init__(self) -> None:
        self.started, self.gate = threading.Event(), threading.Event()

    def predict(self, items: list[Item]) -> list[Result]:
        self.started.set()
        assert self.gate.wait(30)
        return super().predict(items)


async def test_step_run_twice_reaches_the_next_stage_once(
    harness: Harness, redis: aioredis.Redis
) -> None:
    registry = Registry(builtin_pipelines()).select(["chain"])
    request = Request(
        id="twice",
        pipeline="chain",
        stage="adder",
        step="add",
        payload={"value": 1},
        state={"input": {"value": 1}},
        deadline=time.time() + 60,
        reply_to=harness.keys.reply_stream("test"),
    )
    await redis.xadd(harness.keys.stage_stream("adder"), encode(request))
    gated = GatedAdder()
    first = harness.worker(ADDER, gated, registry, min_idle_ms=600_000)
    second = harness.worker(ADDER, Adder(), registry, min_idle_ms=50, reclaim_interval_ms=10)
    await first.start()
    await second.start()
    slow = harness.run(first, max_batches=1)
    await asyncio.to_thread(gated.started.wait, 10)
    assert await second.run(max_batches=1) == 1  # reclaimed it and ran it
    gated.gate.set()
    await slow  # ran it too, and published after the second worker
    assert len(first.history) == len(second.history) == 1
    assert await redis.xlen(harness.keys.stage_stream("multiplier")) == 1


async def test_redis_killed_and_restarted_from_aof_loses_no_accepted_job(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    monkeypatch.setenv("CONVEYOR_REDIS_URL", url)
    server = start_redis(port, tmp_path / "aof", appendonly=True)
    stage = number_stage(batch_wait_ms=0)
    try:
        http = await harness.gateway([stage], redis_timeout_s=0.5)
        accepted = []
        for v in range(20):
            resp = await http.post("/v1/jobs/double", json={"value": v})
            assert resp.status_code == 202
            accepted.append((v, resp.json()["id"]))
        server.kill()  # SIGKILL: no shutdown save, only the AOF survives
        server.wait(timeout=10)
        assert (await http.post("/v1/jobs/double", json={"value": 0})).status_code == 503
        server = start_redis(port, tmp_path / "aof", appendonly=True)
        worker = harness.worker(stage, Doubler())
        harness.run(worker)

        async def all_done() -> bool:
            for _, job_id in accepted:
                resp = await http.get(f"/v1/jobs/{job_id}")
                if resp.status_code != 200 or resp.json()["status"] != "done":
                    return False
            return True

        await until(all_done)
        for v, job_id in accepted:
            assert (await http.get(f"/v1/jobs/{job_id}")).json()["result"] == {"value": 2 * v}
    finally:
        await harness.close()
        server.terminate()
        server.wait(timeout=10)


async def test_sigterm_under_load_drains_and_leaves_nothing_pending(
    harness: Harness, redis: aioredis.Redis
) -> None:
    sent = await harness.enqueue("slow", [{"value": i} for i in range(200)])
    worker = spawn("workers", "slow", CONVEYOR_TEST_DELAY_S="0.05", CONVEYOR_MAX_BATCH_SIZE="8")
    reply_stream = harness.keys.reply_stream("test")

    async def some_answered() -> bool:
        return bool(await replies_in(redis, reply_stream) >= 16)

    await until(some_answered)
    worker.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(worker.wait, 30) == 0
    stream = harness.keys.stage_stream("slow")
    assert (await redis.xpending(stream, GROUP))["pending"] == 0  # drained, nothing held
    assert await redis.xinfo_consumers(stream, GROUP) == []  # and it left the group
    done_early = await replies_in(redis, reply_stream)
    assert done_early < 200  # it was stopped mid-load
    await harness.worker(SLOW, Doubler()).run(burst=True)
    got = await replies(redis, reply_stream)
    assert len(got) == 200
    assert sorted(r["id"] for r in got) == sorted(r.id for r in sent)


def test_settings_let_a_killed_batch_finish_inside_the_default_deadline() -> None:
    from gateway.settings import GatewaySettings
    from workers.settings import WorkerSettings

    w, g = WorkerSettings(), GatewaySettings()
    worst_reclaim_s = (w.min_idle_ms + w.reclaim_interval_ms) / 1000
    assert worst_reclaim_s * 2 < g.default_timeout_s


async def test_dlq_cli_lists_replays_and_purges(harness: Harness, redis: aioredis.Redis) -> None:
    stage = number_stage(batch_wait_ms=0)
    dlq = harness.keys.dead_letters("double")
    stream = harness.keys.stage_stream("double")
    sent = await harness.enqueue("double", [{"value": 1}, {"value": 2}])
    worker = harness.worker(
        stage, Doubler(), max_deliveries=1, min_idle_ms=10, reclaim_interval_ms=10
    )
    await worker.start()
    await died_running(redis, harness.keys, stream)  # a worker that died running them
    await until(lambda: _claimed_and_lettered(worker, 2))
    assert await redis.xlen(dlq) == 2
    env = dict(os.environ)

    def cli(*args: str) -> str:
        conveyor = str(Path(sys.executable).with_name("conveyor"))
        done = subprocess.run(
            [conveyor, *args], env=env, capture_output=True, text=True, timeout=30, check=True
        )
        return done.stdout

    listing = cli("dlq", "list", "double")
    assert f"request {sent[0].id}" in listing
    assert "deliveries=2" in listing
    assert "2 dead letter(s)" in listing
    first = listing.split()[0]
    # Its worker starts after the replay: --force.
    assert "replayed 1" in cli("dlq", "replay", "double", "--id", first, "--force")
    await harness.worker(stage, Doubler()).run(burst=True)
    got = await replies(redis, harness.keys.reply_stream("test"))
    assert [r["result"] for r in got if r["outcome"] == "ok"] == [{"value": 2}]
    assert "purged 1" in cli("dlq", "purge", "double")
    assert await redis.xlen(dlq) == 0


async def _claimed_and_lettered(worker: Any, n: int) -> bool:
    # drive the worker one batch at a time until it has dead-lettered n entries
    await worker.run(max_batches=1, burst=True)
    return bool(worker.parts.recovery.dead_lettered >= n)


async def test_trimming_never_deletes_pending_or_undelivered_work(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Small stream nodes, so approximate trimming has whole nodes of done work to drop.
    await redis.config_set("stream-node-max-entries", 4)
    stage = number_stage(max_batch_size=10, batch_wait_ms=0)
    stream = harness.keys.stage_stream("double")
    sent = await harness.enqueue("double", [{"value": i} for i in range(60)])
    worker = harness.worker(stage, Doubler(), trim_interval_s=3600)
    await worker.start()
    assert await worker.run(max_batches=3) == 3  # 30 done and acked
    held = await redis.xreadgroup(GROUP, "crashed-worker", {stream: ">"}, count=10)
    undelivered = [e for e, _ in (await redis.xrange(stream) or [])[40:]]
    assert len(undelivered) == 20
    assert await trim(redis, stream) >= 24  # done work went, in whole nodes
    left = {e for e, _ in await redis.xrange(stream) or []}
    assert {e for e, _ in cast(list[Any], held)[0][1]} <= left  # pending kept
    assert set(undelivered) <= left  # undelivered kept
    rescuer = harness.worker(stage, Doubler(), min_idle_ms=10, reclaim_interval_ms=10)

    async def reclaimable() -> bool:  # the crashed worker's entries have gone idle
        idle = await redis.xpending_range(stream, GROUP, "-", "+", 100, idle=20)
        return len(idle) == 10

    await until(reclaimable)
    await rescuer.run(burst=True)
    got = await replies(redis, harness.keys.reply_stream("test"))
    assert sorted(r["id"] for r in got) == sorted(r.id for r in sent)  # all 60, once each
