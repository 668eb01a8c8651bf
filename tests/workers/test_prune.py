"""A stage scaled out and back in does not list its departed workers forever: a live
worker removes from the stage's groups the consumers with no live heartbeat and nothing
delivered for ``CONVEYOR_PRUNE_GONE_S``, once they hold nothing pending (their entries
taken back first), so ``conveyor status`` and ``/status`` stop showing them."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from pipelines.keys import GROUP
from runtime.redisio import ensure_group, text
from runtime.status import stage_status
from tests.helpers import Doubler, Harness, number_stage, replies_in, until
from workers.prune import PRUNE_SCRIPT, prune_gone
from workers.settings import WorkerSettings

GONE_S = 0.2
"""The bound here: a consumer silent this long is gone (default an hour)."""


async def members(redis: aioredis.Redis, stream: str) -> dict[str, int]:
    """The consumers of the stream's group, with their pending counts."""
    return {text(c["name"]): int(c["pending"]) for c in await redis.xinfo_consumers(stream, GROUP)}


async def ghost(harness: Harness, redis: aioredis.Redis, name: str, *, beat_ms: int) -> str:
    """A consumer ``name`` in stage ``double``'s group, its heartbeat running out
    ``beat_ms`` from now (negative: run out), once Redis calls it idle for ``GONE_S``."""
    stream = harness.keys.stage_stream("double")
    await ensure_group(redis, stream)
    await redis.xgroup_createconsumer(stream, GROUP, name)
    seconds, micros = await redis.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    await redis.hset(harness.keys.alive("double"), name, str(now_ms + beat_ms))
    return stream


async def idle_past_bound(redis: aioredis.Redis, stream: str, names: set[str]) -> None:
    async def idle() -> bool:
        info = await redis.xinfo_consumers(stream, GROUP)
        return all(int(c["idle"]) >= GONE_S * 1000 for c in info if text(c["name"]) in names)

    await until(idle, 10)


def test_the_bound_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert WorkerSettings().prune_gone_s == 3600
    monkeypatch.setenv("CONVEYOR_PRUNE_GONE_S", "0")
    with pytest.raises(ValueError, match="prune_gone_s"):
        WorkerSettings()


async def test_a_gone_consumer_holding_nothing_is_removed_by_a_worker(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stream = await ghost(harness, redis, "gone-1", beat_ms=-60_000)
    await ghost(harness, redis, "idle-but-alive", beat_ms=60_000)
    await idle_past_bound(redis, stream, {"gone-1", "idle-but-alive"})
    assert {"gone-1", "idle-but-alive"} <= set(await members(redis, stream))
    await harness.enqueue("double", [{"value": 1}])
    worker = harness.worker(number_stage(), Doubler(), prune_gone_s=GONE_S)
    assert await harness.run(worker, max_batches=1) == 1
    left = await members(redis, stream)
    assert "gone-1" not in left
    assert "idle-but-alive" in left  # its heartbeat is live: an idle worker, not gone
    shown = [c.name for c in (await stage_status(redis, harness.keys, "double")).consumers]
    assert "gone-1" not in shown
    assert worker.consumer in shown


async def test_a_gone_consumer_holding_entries_stays_until_they_are_taken_back(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stream = await ghost(harness, redis, "gone-2", beat_ms=-60_000)
    await harness.enqueue("double", [{"value": 2}])
    read = await redis.xreadgroup(GROUP, "gone-2", {stream: ">"}, count=1)
    assert read  # it died holding this entry
    await idle_past_bound(redis, stream, {"gone-2"})
    lanes = [stream]
    assert await prune_gone(redis, harness.keys, "double", lanes, "me", GONE_S) == []
    # The script itself refuses, whatever the caller checked: its entry would be lost.
    assert await redis.eval(PRUNE_SCRIPT, 1, stream, GROUP, "gone-2") == 0
    assert await members(redis, stream) == {"gone-2": 1}

    worker = harness.worker(
        number_stage(), Doubler(), prune_gone_s=GONE_S, min_idle_ms=100, reclaim_interval_ms=50
    )
    harness.run(worker)
    replies = harness.keys.reply_stream("test")

    async def answered_and_pruned() -> bool:
        return await replies_in(redis, replies) == 1 and "gone-2" not in await members(
            redis, stream
        )

    await until(answered_and_pruned, 30)  # taken back, answered, then removed
    assert await replies_in(redis, replies) == 1


async def test_a_stream_forged_to_another_type_is_skipped(
    harness: Harness, redis: aioredis.Redis
) -> None:
    forged = harness.keys.stage_stream("double")
    await redis.set(forged, "not a stream")
    assert await prune_gone(redis, harness.keys, "double", [forged], "me", GONE_S) == []
