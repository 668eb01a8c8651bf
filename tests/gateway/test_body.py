"""Hostile JSON through a real gateway (uvicorn on loopback) with real workers.

Each body here once got a 500, or was accepted and then dropped by the worker's
decoding (the caller waited out its deadline). Now each is a 422 that names the field,
nothing is enqueued, and a good request sent alongside is answered.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import redis.asyncio as aioredis

from pipelines.builtin import builtin_pipelines
from pipelines.envelope import MAX_DEPTH
from pipelines.graph import Registry
from tests.helpers import Harness

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
    "integer past 64 bits": ('{"x": 123456789012345678901234567890}', ["body", "x"]),
    "integer below int64": ('{"x": [1, -9223372036854775809]}', ["body", "x", 1]),
    "thousands of digits": ('{"x": 1' + "0" * 5000 + "}", ["body"]),
    "NaN": ('{"x": NaN}', ["body", "x"]),
    "Infinity": ('{"x": {"y": -Infinity}}', ["body", "x", "y"]),
    "overflowing float": ('{"x": 1e400}', ["body", "x"]),
}


@pytest.fixture
async def gateway(harness: Harness) -> str:
    wanted = ("echo", "chain", "broadcast")
    registry = Registry([p for p in builtin_pipelines() if p.name in wanted])
    for stage in registry.stages.values():
        worker = harness.worker(stage, registry=registry)
        await worker.start()
        harness.run(worker)
    return await harness.http_server(registry)


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_body_is_a_422_naming_the_field(
    gateway: str, redis: aioredis.Redis, harness: Harness, case: str
) -> None:
    body, loc = HOSTILE[case]
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as http:
        good = http.post("/v1/echo", json={"fine": [1, 2.5, "ok"]}, headers=JSON)
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


async def test_float_field_reading_inf_from_a_string_is_refused(
    gateway: str, redis: aioredis.Redis, harness: Harness
) -> None:
    # pydantic reads the string "inf" into a float field: the body parser cannot see it,
    # so the payload as it would be enqueued is checked too.
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as http:
        resp = await http.post("/v1/chain", json={"value": "inf"}, headers=JSON)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"][0]["loc"] == ["body", "value"]
    assert await redis.xlen(harness.keys.stage_stream("adder")) == 0


async def test_a_result_json_cannot_carry_is_a_422_not_null(gateway: str) -> None:
    # 1e308 + 1, doubled, is infinite: the encoder used to write it as null.
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as http:
        huge, fine = await asyncio.gather(
            http.post("/v1/chain", json={"value": 1e308}, headers=JSON),
            http.post("/v1/chain", json={"value": 5}, headers=JSON),
        )
        both = await http.post("/v1/broadcast", json={"value": 1e308}, headers=JSON)
    assert huge.status_code == 422, huge.text
    assert "not finite" in huge.json()["detail"][0]["msg"]
    assert fine.json() == {"value": 12.0}
    assert both.status_code == 422, both.text  # one branch failed: the join never fires
