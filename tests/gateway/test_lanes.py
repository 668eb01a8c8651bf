"""Priority lanes at the gateway: the ``X-Conveyor-Priority`` header and each route's
default lane (read back from the streams, no worker running), the stage state per lane,
admission across lanes and the lane label of the queue gauges."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.admission import Admission
from pipelines.envelope import Request, decode_request
from pipelines.errors import Overloaded
from pipelines.keys import GROUP, Lane
from pipelines.stages import GenerateIn, Stage
from runtime.status import LaneStatus, stage_status
from tests.helpers import Harness, beating, number_stage

FAST = {"X-Conveyor-Timeout": "0.2"}  # no worker runs: a sync call ends in a 504


async def queued(redis: aioredis.Redis, harness: Harness, stage: str, lane: Lane) -> list[Request]:
    """The requests on ``stage``'s stream of ``lane``, oldest first (XRANGE)."""
    entries: Any = await redis.xrange(harness.keys.stage_stream(stage, lane))
    return [decode_request(fields) for _, fields in entries]


async def put(harness: Harness, stage: str, lane: Lane, count: int) -> None:
    """XADD ``count`` requests to ``stage``'s stream of ``lane``, as a gateway would."""
    await harness.enqueue(stage, [{"value": i} for i in range(count)], lane=lane)


PRIORITY = "X-Conveyor-Priority"


def text_stage() -> Stage:
    # One required string field and streaming: POST, GET ?text= and /stream routes.
    return Stage("held", GenerateIn, runner="unused", streaming=True)


async def test_each_route_has_its_default_lane_and_the_header_picks_another(
    harness: Harness, redis: aioredis.Redis
) -> None:
    http = await harness.gateway([text_stage()])
    body = {"text": "hi"}
    bulk = {**FAST, "X-Conveyor-Priority": "bulk"}
    assert (await http.post("/v1/held", json=body, headers=FAST)).status_code == 504
    sync_bulk = await http.post("/v1/held", json={"text": "sync-bulk"}, headers=bulk)
    assert sync_bulk.status_code == 504
    got = await http.get("/v1/held", params={"text": "get-bulk"}, headers=bulk)
    assert got.status_code == 504
    stream = await http.post("/v1/held/stream", json={"text": "stream"}, headers=FAST)
    assert "event: error" in stream.text  # its deadline passed, the events ended
    job = await http.post("/v1/jobs/held", json={"text": "job"})
    assert job.status_code == 202
    urgent = {"X-Conveyor-Priority": "interactive"}
    job_now = await http.post("/v1/jobs/held", json={"text": "job-now"}, headers=urgent)
    assert job_now.status_code == 202

    interactive = await queued(redis, harness, "held", "interactive")
    bulk_lane = await queued(redis, harness, "held", "bulk")
    assert [(r.payload["text"], r.lane) for r in interactive] == [
        ("hi", "interactive"),
        ("stream", "interactive"),
        ("job-now", "interactive"),
    ]
    assert [(r.payload["text"], r.lane) for r in bulk_lane] == [
        ("sync-bulk", "bulk"),
        ("get-bulk", "bulk"),
        ("job", "bulk"),
    ]
    assert bulk_lane[-1].id == job.json()["id"]


async def test_an_unknown_priority_is_a_422_naming_the_header(
    harness: Harness, redis: aioredis.Redis
) -> None:
    http = await harness.gateway([text_stage()])
    bad = {"X-Conveyor-Priority": "urgent"}
    answers = [
        await http.post("/v1/held", json={"text": "a"}, headers=bad),
        await http.get("/v1/held", params={"text": "a"}, headers=bad),
        await http.post("/v1/held/stream", json={"text": "a"}, headers=bad),
        await http.post("/v1/jobs/held", json={"text": "a"}, headers=bad),
    ]
    for resp in answers:
        assert resp.status_code == 422, resp.text
        assert resp.json()["detail"][0]["loc"] == ["header", "X-Conveyor-Priority"]
    for lane in ("interactive", "bulk"):
        assert await redis.xlen(harness.keys.stage_stream("held", lane)) == 0


async def test_stage_status_reads_each_lane(harness: Harness, redis: aioredis.Redis) -> None:
    await put(harness, "double", "interactive", 3)
    await put(harness, "double", "bulk", 5)
    bulk = harness.keys.stage_stream("double", "bulk")
    await redis.xgroup_create(bulk, GROUP, id="0")
    await redis.xreadgroup(GROUP, "w1", {bulk: ">"}, count=2)  # two bulk ones in flight
    status = await stage_status(redis, harness.keys, "double")
    assert status.lanes == {
        "interactive": LaneStatus(length=3, lag=3, pending=0),
        "bulk": LaneStatus(length=5, lag=3, pending=2),
    }
    assert (status.length, status.lag, status.pending, status.backlog) == (8, 6, 2, 8)
    assert [(c.name, c.pending) for c in status.consumers] == [("w1", 2)]


async def test_a_worker_in_both_lane_groups_is_one_consumer(
    harness: Harness, redis: aioredis.Redis
) -> None:
    await put(harness, "double", "interactive", 1)
    await put(harness, "double", "bulk", 2)
    for lane in ("interactive", "bulk"):
        stream = harness.keys.stage_stream("double", lane)
        await redis.xgroup_create(stream, GROUP, id="0")
        await redis.xreadgroup(GROUP, "w1", {stream: ">"})
    await beating(redis, harness.keys, "double", "w1")
    status = await stage_status(redis, harness.keys, "double")
    assert [(c.name, c.pending) for c in status.consumers] == [("w1", 3)]
    assert status.workers == 1


async def test_each_lane_is_held_to_the_backlog_bound_alone(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # A deep bulk backlog refuses bulk work, never an interactive call; and the reverse.
    stages = [number_stage("deep-bulk"), number_stage("deep-interactive")]
    http = await harness.gateway(stages, max_backlog=3, admission_refresh_ms=0)
    await put(harness, "deep-bulk", "bulk", 3)
    await put(harness, "deep-interactive", "interactive", 3)
    for stage, full, free in (
        ("deep-bulk", "bulk", "interactive"),
        ("deep-interactive", "interactive", "bulk"),
    ):
        refused = await http.post(f"/v1/{stage}", json={"value": 1}, headers={PRIORITY: full})
        assert refused.status_code == 503, refused.text
        assert f"3 waiting in its {full} lane, bound 3" in refused.json()["detail"]
        admitted = await http.post(f"/v1/jobs/{stage}", json={"value": 1}, headers={PRIORITY: free})
        assert admitted.status_code == 202, admitted.text


async def test_an_interactive_request_is_predicted_behind_the_interactive_lane_only(
    harness: Harness, redis: aioredis.Redis
) -> None:
    await put(harness, "double", "bulk", 40)
    stream = harness.keys.stage_stream("double")
    await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    await redis.xgroup_createconsumer(stream, GROUP, "busy-worker")
    await beating(redis, harness.keys, "double", "busy-worker")  # one live worker
    # 0.5 s per batch + 0.1 s per item: 40 bulk requests ahead take ~6.5 s
    await redis.hset(harness.keys.stage_stats("double"), mapping={"cost:a": 0.5, "cost:b": 0.1})
    admission = Admission(redis, harness.keys, refresh_s=0.0, retry_after_s=1)
    await admission.admit("double", 1000, 2.0, 8, "interactive")  # nothing ahead of it
    await put(harness, "double", "interactive", 3)
    await admission.refresh("double")
    await admission.admit("double", 1000, 2.0, 8, "interactive")  # 4 ahead: ~0.9 s
    with pytest.raises(Overloaded, match="past its 2s deadline"):  # 44 ahead: ~6.9 s
        await admission.admit("double", 1000, 2.0, 8, "bulk")


async def test_the_queue_gauges_have_a_series_per_lane(
    harness: Harness, redis: aioredis.Redis
) -> None:
    http: httpx.AsyncClient = await harness.gateway([number_stage()])
    await put(harness, "double", "interactive", 2)
    await put(harness, "double", "bulk", 5)
    text = (await http.get("/metrics")).text
    assert 'conveyor_stage_backlog{stage="double",lane="interactive"} 2' in text
    assert 'conveyor_stage_backlog{stage="double",lane="bulk"} 5' in text
    assert 'conveyor_stage_pending{stage="double",lane="interactive"} 0' in text
    assert 'conveyor_stage_pending{stage="double",lane="bulk"} 0' in text
    assert 'conveyor_stage_backlog{stage="double"}' not in text


async def test_the_status_snapshot_breaks_the_queue_down_by_lane(harness: Harness) -> None:
    http = await harness.gateway([number_stage()])
    await put(harness, "double", "interactive", 2)
    await put(harness, "double", "bulk", 5)
    [double] = (await http.get("/status.json")).json()["stages"]
    assert (double["lag"], double["pending"]) == (7, 0)
    assert double["lanes"] == {
        "interactive": {"lag": 2, "pending": 0},
        "bulk": {"lag": 5, "pending": 0},
    }
