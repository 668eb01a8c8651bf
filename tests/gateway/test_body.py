"""Hostile JSON through a real gateway (uvicorn on loopback) with real workers.

Each body here once got a 500, or was accepted and then dropped by the worker's
decoding (the caller waited out its deadline). Now each is a 422 that names the field,
nothing is enqueued, and a good request sent alongside is answered.
"""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel

from pipelines.builtin import builtin_pipelines
from pipelines.envelope import MAX_DEPTH
from pipelines.model import Item, Result
from pipelines.registry import Registry
from pipelines.stages import Stage
from tests.helpers import Harness, number_stage

JSON = {"content-type": "application/json", "X-Conveyor-Timeout": "10"}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE = {
    # body: (status, the loc a 422 names, or None for FastAPI's json_invalid)
    "one level too deep": ('{"a": ' + nested(MAX_DEPTH) + "}", ["body", "a", *[0] * 63]),
    "deep enough to drop": ('{"a": ' + nested(200) + "}", ["body", "a", *[0] * 63]),
    "past pydantic's limit": ('{"a": ' + nested(300) + "}", ["body", "a", *[0] * 63]),
    "past the parser's limit": ('{"a": ' + nested(100_000) + "}", ["body"]),
    "lone surrogate": ('{"text": "a\\ud800b"}', ["body", "text"]),
    "surrogate in a key": ('{"a\\udfffb": 1}', ["body"]),
    "an integer past any float": ('{"x": [1, 1' + "0" * 5000 + "]}", ["body", "x", 1]),
    "NaN": ('{"x": NaN}', ["body", "x"]),
    "Infinity": ('{"x": {"y": -Infinity}}', ["body", "x", "y"]),
    "overflowing float": ('{"x": 1e400}', ["body", "x"]),
}


@pytest.fixture
async def gateway(harness: Harness) -> str:
    wanted = ("echo", "chain", "broadcast")
    registry = Registry([p for p in builtin_pipelines() if p.name in wanted])
    await harness.start_workers(registry)
    return await harness.http_server(registry)


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_body_is_a_422_naming_the_field(
    gateway: str, redis: aioredis.Redis, harness: Harness, case: str
) -> None:
    body, loc = HOSTILE[case]
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as http:
        good = asyncio.create_task(
            http.post("/v1/echo", json={"fine": [1, 2.5, "ok"]}, headers=JSON)
        )
        for path in ("/v1/echo", "/v1/jobs/echo"):
            resp = await http.post(path, content=body, headers=JSON)
            assert resp.status_code == 422, resp.text
            detail = resp.json()["detail"]
            assert detail[0]["loc"] == loc
            assert "input" not in detail[0]  # a hostile body is not echoed back
        answered = await good
    assert answered.status_code == 200
    assert answered.json() == {"fine": [1, 2.5, "ok"]}
    assert await redis.xlen(harness.keys.stage_stream("echo")) == 1  # only the good one


async def test_integers_past_64_bits_are_read_as_the_nearest_float(gateway: str) -> None:
    # Once a 500 (the encoder raised). JSON Schema calls them numbers; JavaScript and
    # orjson read them as floats; so does the gateway. An integer field refuses them.
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as http:
        resp = await http.post(
            "/v1/echo", content='{"x": [123456789012345678901234567890, 7]}', headers=JSON
        )
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"x": [1.2345678901234568e29, 7]}


async def test_float_field_reading_inf_from_a_string_is_refused(
    redis: aioredis.Redis, harness: Harness
) -> None:
    # A lax float field reads the string "inf": the body parser cannot see it, so the
    # payload as it would be enqueued is checked too.
    stage = Stage("lax", LaxIn, "workers.models.toy:Adder")
    http = await harness.gateway([stage])
    resp = await http.post("/v1/lax", json={"value": "inf"})
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"][0]["loc"] == ["body", "value"]
    assert await redis.xlen(harness.keys.stage_stream("lax")) == 0


async def test_a_value_past_the_schema_bound_is_refused_before_enqueueing(
    gateway: str, redis: aioredis.Redis, harness: Harness
) -> None:
    # 1e308 + 1, doubled, is infinite: the encoder once wrote it as null ({"value": null}).
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as http:
        resp = await http.post("/v1/chain", json={"value": 1e308}, headers=JSON)
        fine = await http.post("/v1/chain", json={"value": 1e300}, headers=JSON)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"][0]["loc"] == ["body", "value"]
    assert fine.json() == {"value": (1e300 + 1) * 2}


class LaxIn(BaseModel):
    value: float


class NotANumber:
    """Answers NaN for negative values: a model bug JSON cannot carry."""

    def predict(self, items: list[Item]) -> list[Result]:
        return [{"value": math.nan if i["value"] < 0 else i["value"]} for i in items]


async def test_a_result_json_cannot_carry_fails_alone_with_a_422(harness: Harness) -> None:
    stage = number_stage("nan", max_batch_size=8, batch_wait_ms=20)
    worker = harness.worker(stage, NotANumber())
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([stage])
    bad, good = await asyncio.gather(
        http.post("/v1/nan", json={"value": -1}), http.post("/v1/nan", json={"value": 3})
    )
    assert bad.status_code == 422, bad.text  # once: 200 {"value": null}
    assert "not finite" in bad.json()["detail"][0]["msg"]
    assert good.json() == {"value": 3}
