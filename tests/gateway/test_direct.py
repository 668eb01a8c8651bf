"""A pipeline's call, a job's submission and an OpenAI-compatible call answered on their
connection (gateway/direct.py, gateway/protocol.py): the same answer as through the app,
in order among pipelined requests, keep-alive and ``Connection: close`` kept, the edge's
refusals (keys, a late body) kept, and whatever the path does not take (a completion
asked to stream among them) answered by the app as before."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
from typing import Any, cast

import httpx
import orjson
import pytest

from gateway.app import GatewayApp, create_app
from gateway.corked import Corked
from gateway.settings import GatewaySettings
from pipelines.graph import single
from pipelines.registry import Registry
from runtime import tracing
from tests.gateway.test_hot_path_openai import (
    CHAT,
    TALK,
    VEC,
    C,
    E,
    Reverser,
    Vectors,
    _body,
    _text,
    _value,
    same,
)
from tests.helpers import Doubler, Harness, number_stage, until

PLAIN = {"Content-Type": "application/json"}


async def serve(harness: Harness, **gateway: Any) -> tuple[str, Any]:
    """A gateway on a loopback port with a doubling worker; its base URL and the calls it
    answers on the connection."""
    stage = number_stage()
    harness.run(harness.worker(stage, Doubler()))
    base = await harness.http_server([stage], **gateway)
    keys = {"X-API-Key": gateway["api_keys"][0]} if gateway.get("api_keys") else {}
    async with httpx.AsyncClient(base_url=base, timeout=30, headers=keys) as client:
        assert (await client.post("/v1/double", json={"value": 0})).status_code == 200
    direct = app_of(harness).on_connection
    assert direct is not None
    return base, direct


async def serve_openai(harness: Harness) -> tuple[str, Any]:
    """A gateway on a loopback port with an embeddings stage and a completions stage (no
    models); its base URL and the calls it answers on the connection."""
    harness.run(harness.worker(VEC, Vectors()))
    harness.run(harness.worker(TALK, Reverser()))
    base = await harness.http_server([VEC, TALK])
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert (await client.get("/v1/models")).status_code == 200  # the app settles
    direct = app_of(harness).on_connection
    assert direct is not None
    return base, direct


def app_of(harness: Harness) -> GatewayApp:
    """The app of the harness's last HTTP server."""
    return cast(GatewayApp, harness._servers[-1][0].config.app)


def request(body: bytes, *extra: str) -> bytes:
    head = [
        "POST /v1/double HTTP/1.1",
        "Host: gateway",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def responses(
    reader: asyncio.StreamReader, count: int
) -> list[tuple[int, dict[str, str], bytes]]:
    """``count`` responses read off a raw connection: status, headers, body."""
    found: list[tuple[int, dict[str, str], bytes]] = []
    while len(found) < count:
        status_line = await asyncio.wait_for(reader.readline(), 30)
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if status < 200:  # an interim answer (100 Continue): the final one follows
            continue
        body = await reader.readexactly(int(headers["content-length"]))
        found.append((status, headers, body))
    return found


async def test_a_call_is_answered_on_its_connection_as_the_app_answers_it(
    harness: Harness,
) -> None:
    base, direct = await serve(harness)
    before = direct.answered
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for value in range(1, 6):  # one keep-alive connection
            resp = await client.post("/v1/double", json={"value": value})
            assert resp.status_code == 200
            assert resp.json() == {"value": 2 * value}
        # Through the app (a CORS request is the app's): the same answer, the same headers.
        through_app = await client.post(
            "/v1/double", json={"value": 5}, headers={"Origin": "http://elsewhere"}
        )
        metrics = (await client.get("/metrics")).text
    assert direct.answered == before + 5
    assert through_app.json() == resp.json()
    assert set(resp.headers) == set(through_app.headers)
    same = ("content-type", "content-length", "server")
    assert [resp.headers[h] for h in same] == [through_app.headers[h] for h in same]
    assert len(resp.headers["x-request-id"]) == 32
    assert resp.headers["content-type"] == "application/json"
    assert "date" in resp.headers
    # Counted under the pipeline's route, as the edge counts a call: 1 + 5 + 1.
    line = 'conveyor_http_requests_total{route="/v1/double",status="200"} 7'
    assert line in metrics.splitlines(), [m for m in metrics.splitlines() if "/v1/double" in m]


async def test_a_call_answered_on_its_connection_leaves_before_it_is_logged(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its response is written at once, whole, before the access line and the metrics
    (and before any other work of that moment, a reply read's next XREAD among them)."""
    base, direct = await serve(harness)
    order: list[str] = []
    send, observe = Corked.send, direct.observe

    def sending(corked: Corked, data: bytes) -> None:
        send(corked, data)
        order.append("held" if corked._held else "sent")  # on the socket, or not yet

    def observing(*args: Any) -> None:
        order.append("observed")
        observe(*args)

    monkeypatch.setattr(Corked, "send", sending)
    monkeypatch.setattr(direct, "observe", observing)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        resp = await client.post("/v1/double", json={"value": 4})
    assert resp.json() == {"value": 8}
    assert order == ["sent", "observed"]


async def test_pipelined_requests_are_answered_in_order_whoever_answers_them(
    harness: Harness,
) -> None:
    base, direct = await serve(harness)
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    before = direct.answered
    try:
        writer.write(
            request(b'{"value": 1}')
            + request(b'{"value": "not a number"}')  # the app's 422
            + request(b'{"value": 3}', "Expect: 100-continue")  # the app's
            + request(b'{"value": 4}')
            + request(b'{"value": 5}', "Connection: close")
        )
        await writer.drain()
        got = await responses(reader, 5)
        assert [status for status, _, _ in got] == [200, 422, 200, 200, 200]
        bodies = [orjson.loads(body) for _, _, body in got]
        assert bodies[0] == {"value": 2}
        assert bodies[1]["detail"][0]["loc"] == ["body", "value"]
        assert bodies[2:] == [{"value": 6}, {"value": 8}, {"value": 10}]
        assert got[4][1]["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 30) == b""  # closed after it
        # The first on the connection at least; the rest came (in the same read, as a
        # rule) while one was answered, and queued behind it in uvicorn's pipeline.
        assert 1 <= direct.answered - before <= 3
    finally:
        writer.close()


async def test_a_body_slower_than_the_client_deadline_is_refused_408(harness: Harness) -> None:
    base, _ = await serve(harness, client_timeout_s=1.0)
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        whole = request(b'{"value": 7}')
        writer.write(whole[:-4])  # the body's last bytes never come
        await writer.drain()
        ((status, headers, body),) = await responses(reader, 1)
        assert status == 408
        assert "body did not arrive within 1 s" in orjson.loads(body)["detail"]
        assert headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 30) == b""
    finally:
        writer.close()
    # A body that comes in pieces within the deadline is answered.
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(whole[:-4])
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(whole[-4:])
        ((status, _, body),) = await responses(reader, 1)
        assert (status, orjson.loads(body)) == (200, {"value": 14})
    finally:
        writer.close()


async def test_keys_are_checked_as_at_the_edge(harness: Harness) -> None:
    base, direct = await serve(harness, api_keys=["k-1"])
    before = direct.answered
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        refused = await client.post("/v1/double", json={"value": 1})
        wrong = await client.post(
            "/v1/double", json={"value": 1}, headers={"Authorization": "Bearer nope"}
        )
        taken = await client.post("/v1/double", json={"value": 1}, headers={"X-API-Key": "k-1"})
    assert (refused.status_code, wrong.status_code) == (401, 401)
    assert refused.headers["www-authenticate"] == "Bearer"
    assert taken.status_code == 200
    assert direct.answered == before + 1


async def test_what_the_path_does_not_take_is_answered_by_the_app(harness: Harness) -> None:
    base, direct = await serve(harness, max_body_bytes=64)
    before = direct.answered
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        too_big = await client.post(
            "/v1/double", content=b'{"value": 1, "pad": "' + b"x" * 80 + b'"}', headers=PLAIN
        )
        not_json = await client.post("/v1/double", content=b"{", headers=PLAIN)
        other_type = await client.post(
            "/v1/double", content=b'{"value": 1}', headers={"Content-Type": "text/plain"}
        )

        async def pieces() -> Any:
            for piece in (b'{"value": ', b"2}"):
                yield piece

        chunked = await client.post("/v1/double", content=pieces(), headers=PLAIN)
        query = await client.post("/v1/double?x=1", json={"value": 3})
    assert too_big.status_code == 413
    assert not_json.status_code == 422
    assert not_json.json()["detail"][0]["type"] == "json_invalid"
    assert other_type.status_code == 422
    assert (chunked.status_code, chunked.json()) == (200, {"value": 4})
    assert (query.status_code, query.json()) == (200, {"value": 6})
    assert direct.answered == before


async def test_a_call_whose_body_is_still_coming_at_shutdown_is_answered_then_closed(
    harness: Harness,
) -> None:
    base, direct = await serve(harness)
    before = direct.answered
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        whole = request(b'{"value": 21}')
        writer.write(whole[:-4])
        await writer.drain()
        server = harness._servers[-1][0]

        def pending() -> list[Any]:
            found = [getattr(c, "_pending", None) for c in server.server_state.connections]
            return [p for p in found if p is not None]

        async def taken() -> bool:
            return bool(pending())

        async def shutting() -> bool:
            return any(not p.keep_alive for p in pending())

        await until(taken, 30)  # its body is coming
        server.should_exit = True  # uvicorn's shutdown begins
        await until(shutting, 30)  # and has reached this connection
        writer.write(whole[-4:])
        ((status, headers, body),) = await responses(reader, 1)
        assert (status, orjson.loads(body)) == (200, {"value": 42})
        assert headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 30) == b""
        assert direct.answered == before + 1
    finally:
        writer.close()


async def test_without_the_direct_path_a_call_is_answered_by_the_app_as_before(
    harness: Harness,
) -> None:
    base, direct = await serve(harness)
    app_of(harness).on_connection = None  # as with tracing on
    before = direct.answered
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        got = [await client.post("/v1/double", json={"value": v}) for v in range(3)]
    assert [r.json() for r in got] == [{"value": 0}, {"value": 2}, {"value": 4}]
    assert direct.answered == before


@pytest.mark.parametrize("traced", [False, True])
async def test_tracing_leaves_every_call_to_the_app(
    traced: bool, env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A traced call's root span is FastAPI's: the protocol takes no call then.
    monkeypatch.setattr(tracing.STATE, "enabled", traced)
    app = cast(GatewayApp, create_app(GatewaySettings(), Registry([single(number_stage())])))
    app.settle()
    assert (app.on_connection is None) == traced


async def test_a_client_gone_before_its_body_is_whole_enqueues_nothing(
    harness: Harness,
) -> None:
    base, direct = await serve(harness)
    stream = harness.keys.stage_stream("double")
    entries, before = await harness.redis.xlen(stream), direct.answered
    host, port = base.removeprefix("http://").split(":")
    for _ in range(3):
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(request(b'{"value": 9}')[:-4])  # taken, its body never whole
        await writer.drain()
        writer.close()
        await writer.wait_closed()
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:  # still serving
        assert (await client.post("/v1/double", json={"value": 4})).json() == {"value": 8}
    assert await harness.redis.xlen(stream) == entries + 1  # the last call's alone
    assert direct.answered == before + 1


async def test_a_job_is_taken_on_its_connection_in_the_bulk_lane_owned_by_its_key(
    harness: Harness,
) -> None:
    base, direct = await serve(harness, api_keys=["k-1", "k-2"])
    before = direct.answered
    mine, theirs = {"X-API-Key": "k-1"}, {"X-API-Key": "k-2"}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        taken = await client.post("/v1/jobs/double", json={"value": 4}, headers=mine)
        assert direct.answered == before + 1
        app = await client.post(
            "/v1/jobs/double", json={"value": 5}, headers={**mine, "Origin": "http://elsewhere"}
        )
        assert direct.answered == before + 1  # the app's
        for resp in (taken, app):
            assert resp.status_code == 202, resp.text
            job = resp.json()["id"]
            assert resp.headers["location"] == f"/v1/jobs/{job}" == resp.json()["url"]
            assert resp.headers["x-request-id"] == job
            assert resp.json()["status"] == "queued"
        assert set(taken.headers) == set(app.headers)
        job = taken.json()["id"]

        async def done() -> bool:
            view = (await client.get(f"/v1/jobs/{job}", headers=mine)).json()
            return bool(view["status"] == "done" and view["result"] == {"value": 8})

        await until(done, 30)
        assert (await client.get(f"/v1/jobs/{job}", headers=theirs)).status_code == 404
        # A job asked to run in the interactive lane, taken here too.
        urgent = {**mine, "X-Conveyor-Priority": "interactive"}
        asked = await client.post("/v1/jobs/double", json={"value": 6}, headers=urgent)
        assert asked.status_code == 202, asked.text
        assert direct.answered == before + 2
        metrics = (await client.get("/metrics", headers=mine)).text
    # Two jobs went to the bulk lane; the default (interactive) lane holds serve()'s one
    # call and the job asked to go there.
    assert await harness.redis.xlen(harness.keys.stage_stream("double", "bulk")) == 2
    assert await harness.redis.xlen(harness.keys.stage_stream("double")) == 2
    line = 'conveyor_http_requests_total{route="/v1/jobs/double",status="202"} 3'
    assert line in metrics.splitlines()


async def test_openai_calls_are_taken_on_their_connection_unless_asked_to_stream(
    harness: Harness,
) -> None:
    base, direct = await serve_openai(harness)
    body = {"model": "vec", "input": ["ab", "abc"]}
    app_way = {"Origin": "http://elsewhere"}  # a CORS request is the app's
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        taken = await client.post("/v1/embeddings", json=body)
        assert direct.answered == 1
        app = await client.post("/v1/embeddings", json=body, headers=app_way)
        assert (taken.status_code, app.status_code) == (200, 200), taken.text
        assert taken.json() == app.json()
        assert [d["embedding"] for d in taken.json()["data"]] == [[2, 0.5, -1.0], [3, 0.5, -1.0]]
        assert set(taken.headers) == set(app.headers)
        # A stage that answers no usable embedding: OpenAI's 502 either way.
        bad = {"model": "vec", "input": "empty"}
        refused = await client.post("/v1/embeddings", json=bad)
        assert direct.answered == 2
        refused_app = await client.post("/v1/embeddings", json=bad, headers=app_way)
        assert (refused.status_code, refused_app.status_code) == (502, 502), refused.text
        assert refused.json()["error"]["type"] == refused_app.json()["error"]["type"]
        # The route's own refusals (an unknown model) are the app's.
        unknown = await client.post("/v1/embeddings", json={"model": "nope", "input": "a"})
        assert unknown.status_code == 404
        assert "does not exist" in unknown.json()["error"]["message"]
        assert direct.answered == 2
        # A completion and a chat not asked to stream: taken, answered as the app does.
        asked = {"model": "talk", "prompt": "abc", "n": 2}
        chat = {"model": "talk", "messages": [{"role": "user", "content": "hi"}]}
        answers = []
        for path, sent in (("/v1/completions", asked), ("/v1/chat/completions", chat)):
            one = await client.post(path, json=sent)
            other = await client.post(path, json=sent, headers=app_way)
            assert (one.status_code, other.status_code) == (200, 200), one.text
            mine, theirs = one.json(), other.json()
            for answer in (mine, theirs):
                answer.pop("id"), answer.pop("created")
            assert mine == theirs
            answers.append(mine)
        assert direct.answered == 4
        assert [c["text"] for c in answers[0]["choices"]] == ["cba", "cba"]
        assert answers[1]["choices"][0]["message"]["content"] == "ih :resu"
        # One asked to stream is the app's, whose hot path answers it (here refusing it:
        # this stage does not stream).
        hot = direct.calls.answered
        streamed = await client.post("/v1/completions", json={**asked, "n": 1, "stream": True})
        assert streamed.status_code == 400, streamed.text
        assert streamed.json()["error"]["param"] == "stream"
        assert (direct.answered, direct.calls.answered) == (4, hot + 1)
        metrics = (await client.get("/metrics")).text
    line = 'conveyor_http_requests_total{route="/v1/embeddings",status="200"} 2'
    assert line in metrics.splitlines()
    assert 'route="/v1/embeddings",status="502"} 2' in metrics
    assert 'conveyor_http_requests_total{route="/v1/chat/completions",status="200"} 2' in metrics


def _completion(rng: random.Random) -> tuple[str, bytes]:
    """A completion or a chat for the ``talk`` stage: mostly valid, some fields odd."""
    body: dict[str, Any] = {"model": rng.choice(["talk", "talk", "talk", "vec", "nope"])}
    chat = rng.random() < 0.5
    if chat:
        said = [{"role": rng.choice(["user", "system", "x"]), "content": _text(rng)}]
        body["messages"] = said if rng.random() < 0.8 else _value(rng)
    else:
        body["prompt"] = rng.choice([_text(rng) or "z", [_text(rng) or "z", "b"], _value(rng)])
    for field, values in (
        ("stream", [True, False, "true", 0, None]),
        ("n", [1, 2, 3, 0, 500, "x"]),
        ("max_tokens", [1, 8, 0, -1, 10**9]),
        ("stream_options", [{"include_usage": True}, None, 5]),
        ("temperature", [0.0, 0.7, -1, "hot"]),
    ):
        if rng.random() < 0.3:
            body[field] = rng.choice(values)
    return (CHAT if chat else C), json.dumps(body).encode()


async def test_random_openai_bodies_get_the_same_answer_on_the_connection_and_through_the_app(
    harness: Harness,
) -> None:
    # An attack on what the connection now takes: 200 seeded bodies, many invalid, each
    # sent plain (for the connection) and as a CORS request (the app's). Never a 500;
    # both answer alike; the connection took a good share of embeddings and completions.
    base, direct = await serve_openai(harness)
    rng = random.Random(3737)
    statuses: dict[int, int] = {}
    took: dict[str, int] = {E: 0, C: 0, CHAT: 0}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for turn in range(200):
            path, raw = (E, _body(rng)) if turn % 2 else _completion(rng)
            before = direct.answered
            mine = await client.post(path, content=raw, headers=PLAIN)
            took[path] += direct.answered - before
            app_way = {**PLAIN, "Origin": "http://elsewhere"}
            theirs = await client.post(path, content=raw, headers=app_way)
            assert same(mine) == same(theirs), (path, raw[:200], mine.text[:300], theirs.text[:300])
            assert mine.status_code in (200, 400, 404, 502), (path, raw[:200], mine.text[:300])
            if mine.status_code != 200:
                assert set(mine.json()) == {"error"}, mine.text
            statuses[mine.status_code] = statuses.get(mine.status_code, 0) + 1
    assert statuses.get(200, 0) > 40, statuses
    assert took[E] > 20, took
    assert took[C] + took[CHAT] > 15, took


async def test_calls_redis_refuses_on_the_connection_are_503_and_leave_nothing(
    own_redis: subprocess.Popen[bytes], harness: Harness, namespace: str
) -> None:
    # Redis out of memory under a job and a pipeline's call taken on the connection: each
    # answered 503 with Retry-After, as the app answers it, nothing written; once Redis
    # takes writes again, the connection takes them again.
    redis = harness.redis
    base, direct = await serve(harness)
    app_way = {"Origin": "http://elsewhere"}
    calls = [("/v1/jobs/double", {"value": 5}), ("/v1/double", {"value": 5})]
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        before_keys = {k async for k in redis.scan_iter(f"{namespace}*")}
        before = direct.answered
        try:
            await redis.config_set("maxmemory-policy", "noeviction")
            await redis.config_set("maxmemory", 1)
            for path, body in calls:
                mine = await client.post(path, json=body)
                theirs = await client.post(path, json=body, headers=app_way)
                assert (mine.status_code, theirs.status_code) == (503, 503), mine.text
                assert mine.headers["retry-after"] == theirs.headers["retry-after"]
                assert mine.json() == theirs.json()
        finally:
            await redis.config_set("maxmemory", 0)
        assert direct.answered == before + len(calls)
        assert {k async for k in redis.scan_iter(f"{namespace}*")} == before_keys
        assert (await client.post("/v1/jobs/double", json={"value": 5})).status_code == 202
        assert (await client.post("/v1/double", json={"value": 5})).json() == {"value": 10}
