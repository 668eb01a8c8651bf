"""The edge over real HTTP: what a refusal says (and does not echo), in which order the
edge refuses, and slow clients cut off on a real uvicorn over real sockets."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.responses import ErrorBody, ValidationErrorBody
from tests.helpers import Doubler, Harness, number_stage


async def serve_double(harness: Harness, delay_s: float = 0.0) -> None:
    stage = number_stage(batch_wait_ms=0)
    worker = harness.worker(stage, Doubler(delay_s))
    await worker.start()
    harness.run(worker)


async def test_422_does_not_echo_the_input(harness: Harness) -> None:
    http = await harness.gateway([number_stage()])
    big = "x" * 500_000
    for body in ({"value": big}, {"value": 1, big: 1}, [big[:300_000]] * 3):
        resp = await http.post("/v1/double", json=body)
        assert resp.status_code == 422, resp.text
        assert len(resp.content) < 2_000, resp.content[:200]
        parsed = ValidationErrorBody.model_validate(resp.json())
        assert parsed.detail
        assert all(set(e) <= {"loc", "msg", "type", "ctx"} for e in resp.json()["detail"])
    # Many bad fields: the answer stays small.
    resp = await http.post("/v1/double", json={f"k{i}": i for i in range(5_000)})
    assert resp.status_code == 422
    assert len(resp.content) < 10_000
    # Small constraint details are kept.
    resp = await http.get("/v1/jobs/" + "j" * 200)
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["ctx"] == {"max_length": 128}


async def test_the_key_is_checked_before_the_body_size(harness: Harness) -> None:
    http = await harness.gateway([number_stage()], api_keys=["k1"], max_body_bytes=1000)
    body = b'{"value": 1, "pad": "' + b"x" * 5000 + b'"}'
    resp = await http.post("/v1/double", content=body)
    assert resp.status_code == 401, resp.text  # no key: nothing else is revealed
    ErrorBody.model_validate(resp.json())
    resp = await http.post("/v1/double", content=body, headers={"X-API-Key": "k1"})
    assert resp.status_code == 413, resp.text
    ErrorBody.model_validate(resp.json())


@pytest.mark.parametrize("value", ["null", "nan", "inf", "-inf", "0", "-1", "soon", ""])
async def test_timeout_header_refuses_what_its_schema_excludes(
    harness: Harness, redis: aioredis.Redis, value: str
) -> None:
    http = await harness.gateway([number_stage()])
    schema = next(
        p["schema"]
        for p in (await http.get("/openapi.json")).json()["paths"]["/v1/double"]["post"][
            "parameters"
        ]
        if p["name"] == "X-Conveyor-Timeout"
    )
    assert {k: v for k, v in schema.items() if k not in {"title", "description"}} == {
        "type": "number",
        "exclusiveMinimum": 0,
    }
    resp = await http.post("/v1/double", json={"value": 1}, headers={"X-Conveyor-Timeout": value})
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"][0]["loc"] == ["header", "X-Conveyor-Timeout"]
    assert await redis.xlen(harness.keys.stage_stream("double")) == 0


async def test_timeout_header_takes_any_positive_number(harness: Harness) -> None:
    await serve_double(harness)
    http = await harness.gateway([number_stage()])
    for value in ("5", "0.5e1", "1e9"):
        resp = await http.post(
            "/v1/double", json={"value": 2}, headers={"X-Conveyor-Timeout": value}
        )
        assert resp.status_code == 200, resp.text


async def _exchange(base: str, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection, then read until the server closes it."""
    url = urlsplit(base)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        writer.write(data)
        await writer.drain()
        # The server must answer and close on its own: waited for, bounded only as a
        # backstop far beyond the deadline under test.
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


async def test_slow_clients_are_cut_off(harness: Harness, redis: aioredis.Redis) -> None:
    await serve_double(harness, delay_s=1.0)  # the model takes longer than the deadline
    base = await harness.http_server([number_stage()], client_timeout_s=0.5)

    # Headers that never finish: 408, closed.
    answer = await _exchange(base, b"POST /v1/double HTTP/1.1\r\nHost: gateway\r\nX-Pad: a")
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"headers did not arrive" in answer

    # A connection that never says anything: closed, silently.
    assert await _exchange(base, b"") == b""

    # A body that never finishes: 408, closed, nothing enqueued.
    head = (
        b"POST /v1/double HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    answer = await _exchange(base, head + b'{"value": ')
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"body did not arrive" in answer
    assert await redis.xlen(harness.keys.stage_stream("double")) == 0

    # A client that sends promptly is never cut off, however long the answer takes.
    async with httpx.AsyncClient(base_url=base) as http:
        resp = await http.post("/v1/double", json={"value": 3})
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"value": 6}
        resp = await http.post("/v1/double", json={"value": 4})  # the same connection again
        assert resp.status_code == 200, resp.text


async def test_ambiguous_credentials_are_refused(harness: Harness) -> None:
    # schemathesis (keys on) found a valid X-API-Key accepted beside a wrong Authorization.
    http = await harness.gateway([number_stage()], api_keys=["k1", "k2"])
    body = {"value": 1}
    ok = await http.post("/v1/jobs/double", json=body, headers={"X-API-Key": "k1"})
    assert ok.status_code == 202
    for headers in (
        {"X-API-Key": "k1", "Authorization": "Basic Zm9vOmJhcg=="},
        {"X-API-Key": "k1", "Authorization": "Bearer wrong"},
        {"X-API-Key": "k1", "Authorization": "Bearer k2"},  # two keys: whose job is it?
    ):
        resp = await http.post("/v1/jobs/double", json=body, headers=headers)
        assert resp.status_code == 401, (headers, resp.text)
    both = {"X-API-Key": "k1", "Authorization": "Bearer k1"}
    assert (await http.post("/v1/jobs/double", json=body, headers=both)).status_code == 202
