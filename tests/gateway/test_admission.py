"""Admission's view of a stage: refreshed off the request path, refusals on fresh data."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.admission import Admission
from pipelines.errors import Overloaded
from pipelines.keys import GROUP
from runtime.redisio import ensure_group, text
from runtime.status import stage_status
from tests.helpers import Doubler, Harness, commands_seen, number_stage, until


async def test_a_refusal_is_decided_on_a_fresh_view(
    harness: Harness, redis: aioredis.Redis
) -> None:
    admission = Admission(redis, harness.keys, refresh_s=0.0, retry_after_s=1)
    await harness.enqueue("double", [{"value": i} for i in range(3)])
    with pytest.raises(Overloaded, match="capacity"):
        await admission.admit("double", 3, 30.0, 8)
    # The backlog drains; the view that refused is stale, but it does not refuse again.
    await redis.delete(harness.keys.stage_stream("double"))
    await admission.admit("double", 3, 30.0, 8)


async def test_closing_stops_a_refresh_under_way(harness: Harness, redis: aioredis.Redis) -> None:
    # A refresh left running past its gateway's close would open a connection on the closed
    # client, which nothing closes. Its cancel lands as the command's send finishes, which
    # Python 3.11's wait_for (around redis-py's send) drops: it must be cancelled again.
    admission = Admission(redis, harness.keys, refresh_s=0.0, retry_after_s=1)
    await admission.admit("double", 3, 30.0, 8)
    await redis.client_pause(1500)  # Redis stops answering for 1.5 s
    await admission.admit("double", 3, 30.0, 8)  # stale: a refresh starts, and waits on Redis
    (refresh,) = [t for t in asyncio.all_tasks() if "Admission.refresh" in repr(t.get_coro())]
    await asyncio.wait_for(admission.close(), timeout=1.0)  # not after the pause
    assert refresh.cancelled()


async def test_admitted_requests_do_not_wait_for_a_refresh(
    harness: Harness, redis: aioredis.Redis
) -> None:
    admission = Admission(redis, harness.keys, refresh_s=0.0, retry_after_s=1)
    await admission.admit("double", 3, 30.0, 8)  # the first view is measured at once
    await redis.client_pause(1500)  # Redis stops answering for 1.5 s
    # Stale, and the refresh cannot finish before the pause ends; the request is decided
    # on the view it has, which admits it.
    await asyncio.wait_for(admission.admit("double", 3, 30.0, 8), timeout=1.0)
    # The refresh it started lands once Redis answers (joined here), and counts both
    # admitted requests as already on the books: only later ones are added to its backlog.
    view = await admission.refresh("double")
    assert (view.state.backlog, view.counted) == (0, {"interactive": 2})


async def test_a_stale_lag_counter_does_not_refuse_a_drained_stage(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # What replaying an AOF leaves on Redis 7.0: the group's cursor restored, its
    # entries-read counter not, so XINFO GROUPS reports a lag of everything ever delivered.
    version = str((await redis.info("server"))["redis_version"])
    if int(version.split(".")[0]) < 7:
        pytest.skip(f"Redis {version} reports no lag (and has no XSETID ENTRIESADDED)")
    stream = harness.keys.stage_stream("double")
    await ensure_group(redis, stream)
    await harness.enqueue("double", [{"value": i} for i in range(15)])
    read: Any = await redis.xreadgroup(GROUP, "c1", {stream: ">"})
    ids = [eid for eid, _ in read[0][1]]
    await redis.xack(stream, GROUP, *ids)
    last = text(ids[-1])
    raw: Any = redis  # redis-py has no XSETID method
    await raw.execute_command("XSETID", stream, last, "ENTRIESADDED", 16_964)
    await redis.xgroup_setid(stream, GROUP, last, entries_read=15)
    groups = await redis.xinfo_groups(stream)
    assert (groups[0]["lag"], await redis.xlen(stream)) == (16_949, 15)  # the poison

    admission = Admission(redis, harness.keys, refresh_s=0.0, retry_after_s=1)
    await admission.admit("double", 1024, 30.0, 8)  # refused "16949 waiting" before
    status = await stage_status(redis, harness.keys, "double")
    assert (status.lag, status.pending) == (0, 0)
    # Work that does arrive is still counted (the counter stays stale: it is re-derived).
    await harness.enqueue("double", [{"value": i} for i in range(5)])
    assert (await admission.refresh("double")).state.backlog == 5
    assert (await stage_status(redis, harness.keys, "double")).lag == 5


async def test_admit_now_decides_without_waiting_only_where_admit_would_not_wait(
    harness: Harness, redis: aioredis.Redis
) -> None:
    admission = Admission(redis, harness.keys, refresh_s=3600.0, retry_after_s=1)
    assert not admission.admit_now("double", 3, 30.0, 8)  # no view yet: admit must measure
    await admission.admit("double", 3, 30.0, 8)  # measured: one admitted
    assert admission.admit_now("double", 3, 30.0, 8)  # a fresh view that admits: at once
    with pytest.raises(Overloaded, match="capacity"):  # a fresh view that refuses: at once
        admission.admit_now("double", 2, 30.0, 8)
    stale = Admission(redis, harness.keys, refresh_s=0.0, retry_after_s=1)
    await harness.enqueue("double", [{"value": i} for i in range(3)])
    with pytest.raises(Overloaded):
        await stale.admit("double", 3, 30.0, 8)
    # Stale and refusing: not decided here (admit waits for the fresh view it started).
    assert not stale.admit_now("double", 3, 30.0, 8)
    assert "double" in stale._refreshing
    await stale.close()


async def test_a_call_that_finds_the_view_stale_is_written_before_the_refresh(
    harness: Harness, redis: aioredis.Redis
) -> None:
    """The background refresh a call starts reads the stage's status after that call's
    XADD is sent, not before it: at one client, every call past the refresh interval
    would otherwise wait behind a status read."""
    stage = number_stage()
    client = await harness.gateway([stage], admission_refresh_ms=20)
    harness.run(harness.worker(stage, Doubler()))
    assert (await client.post("/v1/double", json={"value": 1})).status_code == 200
    stream = harness.keys.stage_stream("double")
    async with commands_seen(redis) as seen:

        def first(name: str) -> int | None:
            found = (i for i, w in enumerate(seen) if w[0].upper() == name and w[1:2] == [stream])
            return next(found, None)

        async def both_seen() -> bool:
            return first("XADD") is not None and first("XLEN") is not None

        await asyncio.sleep(0.1)  # the view is stale (20 ms)
        assert (await client.post("/v1/double", json={"value": 2})).status_code == 200
        await until(both_seen, limit_s=10)
    written, read = first("XADD"), first("XLEN")
    assert written is not None, seen
    assert read is not None, seen
    assert written < read, [w[0] for w in seen]
