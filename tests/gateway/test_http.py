"""The gateway over real HTTP semantics (ASGI) with real workers and Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import httpx
import pytest
import redis.asyncio as aioredis

from conveyor.embedded import free_port
from gateway.app import create_app
from gateway.headers import CORS_HEADERS, HEADERS
from gateway.settings import GatewaySettings
from pipelines.envelope import decode_request
from pipelines.errors import ConfigError
from pipelines.graph import Pipeline, function, single
from pipelines.registry import Registry
from pipelines.stages import AnyIn
from tests.helpers import Doubler, Harness, beating, number_stage


async def serving(harness: Harness, **gateway: object) -> httpx.AsyncClient:
    stage = number_stage(max_batch_size=8, batch_wait_ms=2)
    worker = harness.worker(stage, Doubler())
    await worker.start()
    harness.run(worker)
    return await harness.gateway([stage], **gateway)


async def test_post_round_trip(harness: Harness) -> None:
    http = await serving(harness)
    resp = await http.post("/v1/double", json={"value": 21})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"value": 42}
    assert resp.headers["x-request-id"]


async def test_concurrent_requests_each_get_their_own_answer(harness: Harness) -> None:
    http = await serving(harness)
    resps = await asyncio.gather(*(http.post("/v1/double", json={"value": i}) for i in range(50)))
    assert [r.json()["value"] for r in resps] == [2 * i for i in range(50)]


async def test_422_names_the_field(harness: Harness, redis: aioredis.Redis) -> None:
    http = await serving(harness)
    resp = await http.post("/v1/double", json={"value": "many"})
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"] == ["body", "value"]
    resp = await http.post("/v1/double", json={"value": 1, "extra": 2})
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"] == ["body", "extra"]
    resp = await http.post("/v1/double", json={"value": 1}, headers={"X-Conveyor-Timeout": "-1"})
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"] == ["header", "X-Conveyor-Timeout"]
    assert await redis.xlen(harness.keys.stage_stream("double")) == 0


async def test_413_before_reading_and_nothing_enqueued(
    harness: Harness, redis: aioredis.Redis
) -> None:
    http = await serving(harness, max_body_bytes=1000)
    resp = await http.post("/v1/double", content=b'{"value": 1, "pad": "' + b"x" * 5000 + b'"}')
    assert resp.status_code == 413
    assert "1000 bytes" in resp.json()["detail"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it streams
        for _ in range(10):
            yield b" " * 500

    resp = await http.post(
        "/v1/double", content=chunks(), headers={"content-type": "application/json"}
    )
    assert resp.status_code == 413
    assert await redis.xlen(harness.keys.stage_stream("double")) == 0


async def test_503_when_backlog_is_full(harness: Harness, redis: aioredis.Redis) -> None:
    stage = number_stage()  # no worker: everything queues
    http = await harness.gateway([stage], max_backlog=3, admission_refresh_ms=0)
    await harness.enqueue("double", [{"value": i} for i in range(3)])
    resp = await http.post("/v1/double", json={"value": 1})
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "1"
    assert "capacity" in resp.json()["detail"]
    assert await redis.xlen(harness.keys.stage_stream("double")) == 3


async def test_503_when_redis_is_unreachable(harness: Harness) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    http = await harness.gateway([number_stage()], redis_url=dead, redis_timeout_s=0.5)
    resp = await http.post("/v1/double", json={"value": 1})
    assert resp.status_code == 503
    assert resp.headers["retry-after"]
    assert "unreachable" in resp.json()["detail"]
    ready = await http.get("/readyz")
    assert ready.status_code == 503
    # It says what the connection said, not only that Redis is away.
    assert ready.json()["status"].startswith("redis unreachable: "), ready.text
    assert "refused" in ready.json()["status"].lower() or "connect" in ready.text.lower()
    assert ".py:" not in ready.text  # not where in conveyor it was raised: the probe is open
    assert (await http.get("/healthz")).status_code == 200


async def test_504_when_the_deadline_passes(harness: Harness) -> None:
    http = await harness.gateway([number_stage()])  # no worker
    resp = await http.post("/v1/double", json={"value": 1}, headers={"X-Conveyor-Timeout": "0.2"})
    assert resp.status_code == 504
    body = resp.json()
    assert body["request_id"]
    assert "0.2s" in body["detail"]


async def test_504_when_the_worker_finds_it_expired(harness: Harness) -> None:
    stage = number_stage(max_batch_size=8, batch_wait_ms=0)
    http = await harness.gateway([stage])
    call = asyncio.create_task(
        http.post("/v1/double", json={"value": 1}, headers={"X-Conveyor-Timeout": "0.5"})
    )
    stream = harness.keys.stage_stream("double")
    read = await harness.redis.xread({stream: "0-0"}, count=1, block=10_000)  # enqueued
    request = decode_request(cast(list[Any], read)[0][1][0][1])
    worker = harness.worker(stage, Doubler())
    await worker.start()
    await asyncio.sleep(max(0.0, request.deadline - time.time()) + 0.01)  # past its deadline
    await worker.run(burst=True)
    resp = await call
    assert resp.status_code == 504
    assert (await harness.stats("double")).get("items:expired", 0) == 1


async def test_model_error_is_500_without_internals(harness: Harness) -> None:
    http = await serving(harness)
    resp = await http.post("/v1/double", json={"value": 1, "fail": True})
    assert resp.status_code == 500
    body = resp.json()
    assert "poisoned item" in body["detail"]
    assert "Traceback" not in resp.text
    assert body["request_id"]


async def test_metrics_show_requests_and_stage_counters(harness: Harness) -> None:
    http = await serving(harness)
    for i in range(3):
        assert (await http.post("/v1/double", json={"value": i})).status_code == 200
    text = (await http.get("/metrics")).text
    assert 'conveyor_stage_items_total{stage="double",outcome="ok"} 3' in text
    assert 'conveyor_http_requests_total{route="/v1/double",status="200"} 3' in text
    assert 'conveyor_stage_batch_size_count{stage="double"}' in text
    assert 'conveyor_stage_consumers{stage="double"} 1' in text
    # Three items of 2 estimated tokens each (no text), padded to nothing more.
    assert 'conveyor_stage_tokens_total{stage="double",kind="real"} 6' in text
    assert 'conveyor_stage_tokens_total{stage="double",kind="padded"} 6' in text


async def test_metrics_label_every_route_by_its_template(harness: Harness) -> None:
    http = await serving(harness)
    job = (await http.post("/v1/jobs/double", json={"value": 1})).json()["id"]
    assert (await http.get(f"/v1/jobs/{job}")).status_code == 200
    assert (await http.get("/v1/jobs/no-such-job")).status_code == 404
    assert (await http.get("/status.json")).status_code == 200
    assert (await http.get("/no/such/path")).status_code == 404
    text = (await http.get("/metrics")).text
    assert 'conveyor_http_requests_total{route="/v1/jobs/double",status="202"} 1' in text
    assert 'conveyor_http_requests_total{route="/v1/jobs/{job_id}",status="200"} 1' in text
    assert 'conveyor_http_requests_total{route="/v1/jobs/{job_id}",status="404"} 1' in text
    assert 'conveyor_http_requests_total{route="/status.json",status="200"} 1' in text
    # No route matched: one label for all such paths, never the path itself.
    assert 'conveyor_http_requests_total{route="other",status="404"} 1' in text
    assert "no/such/path" not in text


async def test_openapi_documents_each_stage(harness: Harness) -> None:
    http = await serving(harness)
    schema = (await http.get("/openapi.json")).json()
    assert "/v1/double" in schema["paths"]
    assert "NumberIn" in schema["components"]["schemas"]


async def test_api_keys_guard_every_route_but_the_probes(
    harness: Harness, redis: aioredis.Redis
) -> None:
    http = await serving(harness, api_keys="k1,k2")
    resp = await http.post("/v1/double", json={"value": 1})
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"] == "Bearer"
    assert (
        await http.post("/v1/double", json={"value": 1}, headers={"X-API-Key": "k3"})
    ).status_code == 401
    assert (await http.get("/metrics")).status_code == 401
    assert (await http.get("/healthz")).status_code == 200
    assert (await http.get("/readyz")).status_code == 200
    ok = await http.post("/v1/double", json={"value": 1}, headers={"Authorization": "Bearer k2"})
    assert ok.json() == {"value": 2}
    ok = await http.post("/v1/double", json={"value": 2}, headers={"X-API-Key": "k1"})
    assert ok.json() == {"value": 4}
    # refused requests were never enqueued
    assert await redis.xlen(harness.keys.stage_stream("double")) == 2


async def test_cors_is_off_unless_configured(harness: Harness) -> None:
    http = await serving(harness)
    headers = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    resp = await http.options("/v1/double", headers=headers)
    assert "access-control-allow-origin" not in resp.headers
    http = await harness.gateway([number_stage()], cors_origins="https://app.example")
    resp = await http.options("/v1/double", headers=headers)
    assert resp.headers["access-control-allow-origin"] == "https://app.example"


async def test_cors_preflight_allows_every_declared_header(harness: Harness) -> None:
    # Issue 25: X-Conveyor-Priority was refused ("Disallowed CORS headers") while
    # X-Conveyor-Timeout passed; the allow-list is now derived from the declarations.
    assert {h.name for h in HEADERS} <= set(CORS_HEADERS)
    assert "X-Conveyor-Priority" in CORS_HEADERS
    http = await serving(harness, cors_origins="https://app.example")
    for path in ("/v1/double", "/v1/jobs/double"):
        for header in (*CORS_HEADERS, ",".join(CORS_HEADERS)):
            resp = await http.options(
                path,
                headers={
                    "Origin": "https://app.example",
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": header,
                },
            )
            assert resp.status_code == 200, (path, header, resp.text)
            allowed = resp.headers["access-control-allow-headers"].lower().split(", ")
            assert {h.strip().lower() for h in header.split(",")} <= set(allowed)
    # and the header then does what it says, across origins
    resp = await http.post(
        "/v1/jobs/double",
        json={"value": 1},
        headers={"Origin": "https://app.example", "X-Conveyor-Priority": "interactive"},
    )
    assert resp.status_code == 202
    assert resp.headers["access-control-allow-origin"] == "https://app.example"


def test_every_route_documents_every_declared_header() -> None:
    schema = create_app(GatewaySettings(), Registry([single(number_stage())])).openapi()
    for path in ("/v1/double", "/v1/jobs/double"):
        params = schema["paths"][path]["post"]["parameters"]
        assert [p["name"] for p in params if p["in"] == "header"] == [h.name for h in HEADERS]


async def test_request_that_would_miss_its_deadline_is_refused_at_once(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage(max_batch_size=8)
    http = await harness.gateway([stage], admission_refresh_ms=0)
    await harness.enqueue("double", [{"value": i} for i in range(20)])
    stream = harness.keys.stage_stream("double")
    await redis.xgroup_create(stream, "workers", id="0")
    await redis.xreadgroup("workers", "busy-worker", {stream: ">"}, count=1)
    await beating(redis, harness.keys, "double", "busy-worker")  # one live worker
    # what the workers learned: 0.5 s per batch + 0.1 s per item -> ~3.9 s for this backlog
    await redis.hset(harness.keys.stage_stats("double"), mapping={"cost:a": 0.5, "cost:b": 0.1})
    started = time.perf_counter()
    resp = await http.post("/v1/double", json={"value": 1}, headers={"X-Conveyor-Timeout": "1"})
    assert resp.status_code == 503
    assert "past its 1s deadline" in resp.json()["detail"]
    assert int(resp.headers["retry-after"]) >= 2
    assert time.perf_counter() - started < 1.0  # refused, not timed out
    # one predicted to finish just inside its deadline is refused too: the prediction is
    # a mean, and a batch's run time jitters (CONVEYOR_ADMISSION_HEADROOM, 0.9)
    resp = await http.post("/v1/double", json={"value": 1}, headers={"X-Conveyor-Timeout": "4.2"})
    assert resp.status_code == 503
    assert "within 10% of its 4.2s deadline" in resp.json()["detail"]
    resp = await http.post(
        "/v1/jobs/double", json={"value": 1}, headers={"X-Conveyor-Timeout": "30"}
    )
    assert resp.status_code == 202  # a request with time to spare is taken
    assert await redis.xlen(harness.keys.stage_stream("double", "bulk")) == 1  # a job: bulk


def test_a_pipeline_called_jobs_is_refused_when_the_app_is_built() -> None:
    # /v1/jobs/stream would be both its stream route and the job submit of a pipeline
    # called "stream": the route order would decide which one answers.
    jobs = Pipeline("jobs", AnyIn, (function("run", lambda payload: payload),))
    with pytest.raises(ConfigError, match="'jobs' is taken"):
        create_app(GatewaySettings(), Registry([jobs]))
