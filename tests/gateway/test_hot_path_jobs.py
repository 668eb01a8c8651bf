"""The hot path (gateway/fastpath.py) takes a job's submission (``POST /v1/jobs/{name}``) as
the route does: the same 202 or refusal, the job owned by the caller the edge named, in
the bulk lane unless the caller asked for another, and labelled as the route; a body or a
header it is not sure of goes to the route. Attacked with seeded random bodies, and with
a Redis that refuses the writes."""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from gateway.app import create_app
from gateway.settings import GatewaySettings
from pipelines.envelope import Request, decode_request
from pipelines.graph import Pipeline, single
from pipelines.keys import LANES, Keys
from pipelines.registry import Registry
from tests.gateway.test_hot_path import CASES, PLAIN, ROUTE, both_ways, hot_path, started
from tests.helpers import Doubler, GatewayProcess, Harness, number_stage, until
from tests.support.otlp import receiver
from tests.system.test_tracing import wait_for_spans

SUBMIT = "/v1/jobs/double"
KEY_A = "alpha-secret-key"
KEY_B = "bravo-secret-key"


async def _app(harness: Harness, *, worker: bool = True, **overrides: Any) -> FastAPI:
    stage = number_stage(batch_wait_ms=0)
    if worker:
        running = harness.worker(stage, Doubler())
        await running.start()
        harness.run(running)
    settings = GatewaySettings(**{"reply_block_ms": 100, **overrides})
    return create_app(settings, Registry([single(stage)]))


@pytest.fixture
async def served(harness: Harness) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    app = await _app(harness)
    async with started(app) as http:
        yield app, http


def seen(resp: httpx.Response) -> tuple[int, Any, dict[str, str]]:
    """What a client sees of a submission, less the job's own id (in its body, its url,
    its Location and its X-Request-Id)."""
    try:
        body = resp.json()
    except ValueError:
        body = resp.text
    own = str(body.get("id") or body.get("request_id")) if isinstance(body, dict) else None
    if isinstance(body, dict):
        for field in ("id", "url", "request_id"):
            body.pop(field, None)
    named = {"x-request-id", "retry-after", "content-type", "location", "content-length"}
    headers = {h: v for h, v in resp.headers.items() if h in named}
    if own:
        headers = {h: v.replace(own, "<id>") for h, v in headers.items()}
    if resp.status_code == 202:
        assert headers["location"] == "/v1/jobs/<id>" == resp.json()["url"].replace(own, "<id>")
        assert headers["x-request-id"] == "<id>"
    return resp.status_code, body, headers


async def finished(http: httpx.AsyncClient, job: str, **headers: str) -> dict[str, Any]:
    """The job's view once it is no longer queued."""
    view: dict[str, Any] = {}

    async def done() -> bool:
        resp = await http.get(f"/v1/jobs/{job}", headers=headers)
        assert resp.status_code == 200, resp.text
        view.update(resp.json())
        return bool(view["status"] != "queued")

    await until(done, 20)
    return {k: v for k, v in view.items() if k not in ("id", "created_at", "finished_at")}


async def test_the_hot_path_takes_a_job_as_the_route_does(
    served: tuple[FastAPI, httpx.AsyncClient],
) -> None:
    app, http = served
    calls = hot_path(app)
    for body, headers, plain in CASES:
        hot, route, took = await both_ways(http, calls, SUBMIT, body, headers)
        assert took == plain, (body, headers, hot.text)
        assert seen(hot) == seen(route), (body, headers, hot.text, route.text)
        if hot.status_code == 202:  # and the two jobs end alike
            ends = [await finished(http, r.json()["id"]) for r in (hot, route)]
            assert ends[0] == ends[1], (body, ends)
            assert ends[0]["status"] in ("done", "failed"), ends


async def test_a_hot_job_is_in_the_bulk_lane_unless_asked_otherwise(
    harness: Harness, redis: aioredis.Redis, namespace: str
) -> None:
    # No worker: the entries stay where the submissions put them.
    app = await _app(harness, worker=False)
    keys = Keys(namespace)
    async with started(app) as http:
        calls = hot_path(app)
        lanes = {None: 2, "bulk": 1, "interactive": 3}
        for lane, n in lanes.items():
            headers = PLAIN if lane is None else {**PLAIN, "X-Conveyor-Priority": lane}
            for i in range(n):
                resp = await http.post(SUBMIT, json={"value": i}, headers=headers)
                assert resp.status_code == 202, resp.text
        # A sync call's default is interactive: the one value a job must not take.
        assert calls.answered == sum(lanes.values())
        assert await redis.xlen(keys.stage_stream("double", "bulk")) == 3
        assert await redis.xlen(keys.stage_stream("double", "interactive")) == 3


async def _queued(redis: aioredis.Redis, keys: Keys) -> dict[str, Request]:
    """The requests in the stage's streams, by id."""
    found = {}
    for lane in LANES:
        entries: Any = await redis.xrange(keys.stage_stream("double", lane))
        for _, fields in entries:
            request = decode_request(fields)
            found[request.id] = request
    return found


async def test_a_hot_job_is_queued_as_the_routes_with_its_headers(
    harness: Harness, redis: aioredis.Redis, namespace: str
) -> None:
    # No worker: each job's record and entry stay as the submission wrote them. The two
    # paths must write the same deadline (a job's, 50 s, not a call's 7 s, unless asked
    # for less), lane, trace id, owner and reply key.
    app = await _app(harness, worker=False, job_timeout_s=50, default_timeout_s=7)
    keys = Keys(namespace)
    asked = [
        {},
        {"X-Conveyor-Timeout": "5"},
        {"X-Trace-Id": "trace-abc"},
        {"X-Conveyor-Priority": "interactive"},
        {"X-Conveyor-Timeout": "20", "X-Trace-Id": "t2", "X-Conveyor-Priority": "bulk"},
    ]
    async with started(app) as http:
        calls = hot_path(app)
        pairs = []
        for headers in asked:
            ids = []
            for content in (PLAIN, ROUTE):
                now = await harness.redis.time()
                resp = await http.post(SUBMIT, json={"value": 2}, headers={**content, **headers})
                assert resp.status_code == 202, resp.text
                ids.append((resp.json()["id"], now[0] + now[1] / 1e6))
            pairs.append((headers, ids))
        assert calls.answered == len(asked)
        queued = await _queued(redis, keys)
        for headers, ids in pairs:
            views = []
            for job, sent_at in ids:
                request = queued[job]
                record = await redis.hgetall(keys.job(job))
                views.append(
                    {
                        "budget": round(request.deadline - sent_at),
                        "record_deadline": round(float(record[b"deadline"]) - sent_at),
                        "lane": request.lane,
                        "trace": request.trace_id if "X-Trace-Id" in headers else None,
                        "owner": record[b"owner"],
                        "reply_to": request.reply_to == keys.job(job),
                        "pipeline": record[b"pipeline"],
                    }
                )
            assert views[0] == views[1], (headers, views)
            budget = float(headers.get("X-Conveyor-Timeout", 50))
            assert views[0]["budget"] == views[0]["record_deadline"] == budget, views
            assert views[0]["lane"] == headers.get("X-Conveyor-Priority", "bulk")


async def test_a_hot_job_is_its_submitters_alone(harness: Harness) -> None:
    app = await _app(harness, api_keys=[KEY_A, KEY_B])
    async with started(app) as http:
        calls = hot_path(app)
        refused = await http.post(SUBMIT, json={"value": 4}, headers=PLAIN)
        assert refused.status_code == 401, refused.text  # the edge's, before the hot path
        assert calls.answered == 0
        resp = await http.post(
            SUBMIT, json={"value": 4}, headers={**PLAIN, "Authorization": f"Bearer {KEY_A}"}
        )
        assert resp.status_code == 202, resp.text
        assert calls.answered == 1
        job = resp.json()["id"]
        view = await finished(http, job, Authorization=f"Bearer {KEY_A}")
        assert view["status"] == "done"
        assert view["result"] == {"value": 8}
        other = await http.get(f"/v1/jobs/{job}", headers={"Authorization": f"Bearer {KEY_B}"})
        assert other.status_code == 404, other.text


async def test_a_hot_job_is_labelled_as_its_route(harness: Harness) -> None:
    app = await _app(harness, api_keys=[KEY_A])
    key = {"Authorization": f"Bearer {KEY_A}"}
    async with started(app) as http:
        for headers in (PLAIN, ROUTE):
            resp = await http.post(SUBMIT, json={"value": 1}, headers={**headers, **key})
            assert resp.status_code == 202, resp.text
        assert hot_path(app).answered == 1
        # Refused at the edge: a submission is its route's; a read of a job whose id is
        # the pipeline's name is not (the router would label it /v1/jobs/{job_id}).
        assert (await http.post(SUBMIT, json={"value": 1})).status_code == 401
        assert (await http.get(SUBMIT)).status_code == 401
        metrics = (await http.get("/metrics", headers=key)).text
    jobs = [m for m in metrics.splitlines() if m.startswith("conveyor_http_requests_total")]
    assert 'conveyor_http_requests_total{route="/v1/jobs/double",status="202"} 2' in jobs, jobs
    assert 'conveyor_http_requests_total{route="/v1/jobs/double",status="401"} 1' in jobs, jobs
    assert 'conveyor_http_requests_total{route="other",status="401"} 1' in jobs, jobs


def _value(rng: random.Random) -> Any:
    return rng.choice(
        [0, 7, -3, 2**62, 2**64, 3.0, 3.5, True, None, "4", "", [1], {"v": 1}, 1e308, -0.0]
    )


def _body(rng: random.Random) -> bytes:
    """A submission's body: mostly plausible, some fields wrong, some not JSON at all."""
    roll = rng.random()
    if roll < 0.1:  # not a body the wire carries
        return rng.choice(
            [b"", b"{", b"null", b'{"value": NaN}', b'{"value": 1e400}', b"\xff", b"[" * 90]
        )
    if roll < 0.55:
        plausible: dict[str, Any] = {"value": rng.randint(-(10**6), 10**6)}
        if rng.random() < 0.3:
            plausible["fail"] = rng.random() < 0.5
        return json.dumps(plausible).encode()
    body = {k: _value(rng) for k in ("value", "fail", "x") if rng.random() < 0.6}
    return json.dumps(body).encode()


async def test_random_submissions_get_the_same_answer_from_both_paths_and_never_a_500(
    served: tuple[FastAPI, httpx.AsyncClient],
) -> None:
    # An attack on what the hot path now takes: 120 seeded bodies, many invalid, each
    # submitted through the hot path and through the route. Both answer alike, never a
    # 500; every job taken ends with its own value doubled (or failed when asked to).
    app, http = served
    rng = random.Random(4037)
    calls = hot_path(app)
    took: list[tuple[str, dict[str, Any]]] = []
    statuses: dict[int, int] = {}
    for _ in range(120):
        raw = _body(rng)
        hot, route, hot_took = await both_ways(http, calls, SUBMIT, raw)
        assert seen(hot) == seen(route), (raw[:200], hot.text[:300], route.text[:300])
        assert hot.status_code in (202, 422), (raw[:200], hot.text[:300])
        statuses[hot.status_code] = statuses.get(hot.status_code, 0) + 1
        if hot.status_code == 202:
            assert hot_took
            took.append((hot.json()["id"], json.loads(raw)))
    assert len(took) > 40, statuses
    for job, asked in took:
        view = await finished(http, job)
        if asked.get("fail"):
            assert view["status"] == "failed", view
        else:
            assert view["status"] == "done", view
            assert view["result"] == {"value": 2 * asked["value"]}, (asked, view)


async def test_a_hot_job_redis_refuses_is_a_503_and_leaves_nothing(
    own_redis: subprocess.Popen[bytes], harness: Harness, redis: aioredis.Redis, namespace: str
) -> None:
    app = await _app(harness, worker=False)
    async with started(app) as http:
        calls = hot_path(app)
        before = {k async for k in redis.scan_iter(f"{namespace}*")}
        try:
            await redis.config_set("maxmemory-policy", "noeviction")
            await redis.config_set("maxmemory", 1)
            resp = await http.post(SUBMIT, json={"value": 5}, headers=PLAIN)
        finally:
            await redis.config_set("maxmemory", 0)
        assert calls.answered == 1
        assert resp.status_code == 503, resp.text
        assert resp.headers["retry-after"]
        assert {k async for k in redis.scan_iter(f"{namespace}*")} == before
        again = await http.post(SUBMIT, json={"value": 5}, headers=PLAIN)
        assert again.status_code == 202, again.text
        assert await redis.xlen(Keys(namespace).stage_stream("double", "bulk")) == 1


def pipelines() -> list[Pipeline]:
    """This file's stage, for a real gateway process (``CONVEYOR_APP``)."""
    return [single(number_stage())]


def test_a_refused_hot_request_is_traced_as_its_route(redis_url: str, tmp_path: Path) -> None:
    # Before: the hot path named a request's root span at its admission, so one refused
    # before it (a full backlog, draining, Redis down) kept FastAPI's bare "POST", where
    # the route names it after itself whatever it answers.
    with receiver() as got:
        otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": got.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        app = {"CONVEYOR_APP": "tests.gateway.test_hot_path_jobs:pipelines"}
        bound = {"CONVEYOR_MAX_BACKLOG": "2"}  # no worker: the jobs fill it
        with GatewayProcess(redis_url, tmp_path / "gateway.log", **app, **otel, **bound) as gw:
            roots = {}
            for path in (SUBMIT, "/v1/double"):
                for _ in range(20):  # admitted (a call's 504 a second later) until full
                    resp = httpx.post(
                        f"{gw.base}{path}",
                        json={"value": 1},
                        headers={"X-Conveyor-Timeout": "1"},
                        timeout=60,
                    )
                    if resp.status_code not in (202, 504):
                        break
                assert resp.status_code == 503, resp.text
                _, trace_id, root_id, _ = resp.headers["traceparent"].split("-")
                # Exported as FastAPI names it; a root not so named fails here, naming
                # the spans that came.
                spans = wait_for_spans(got, trace_id, {f"POST {path}"})
                roots[path] = next(s for s in spans if s.span_id == root_id)
    for path, root in roots.items():
        assert root.name == f"POST {path}", (path, root.name)
        assert root.attributes["http.route"] == path
