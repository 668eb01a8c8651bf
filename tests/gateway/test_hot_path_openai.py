"""The hot path (gateway/fastpath.py) on the OpenAI-compatible POST routes: it answers
``/v1/embeddings``, ``/v1/completions`` and ``/v1/chat/completions`` exactly as their
FastAPI routes would (refusals included, in OpenAI's shape) and hands the routes what it
is not sure of; a stage that answers no usable embedding is a 502, never a 500; 150
seeded random bodies (many invalid, some not JSON the wire carries) get the same answer
from both paths and never a 500, and a burst of calls each get their own vectors. Real
workers and a real Redis; the app called in process (ASGI) so the hot path's own count
tells who answered."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import struct
from pathlib import Path
from typing import Any, cast

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

from gateway.app import GatewayApp, create_app
from gateway.settings import GatewaySettings
from pipelines.graph import Pipeline, single
from pipelines.model import Item, Result
from pipelines.registry import Registry
from pipelines.stages import GenerateIn, Stage, TextIn
from tests.gateway.test_cancel import cancelled, queued, raw_request, watchers
from tests.gateway.test_hot_path import both_ways, hot_path, seen, started
from tests.helpers import GatewayProcess, Harness, until
from tests.support.faultapp import spawn, stop
from tests.support.otlp import receiver
from tests.system.test_tracing import wait_for_spans

BAD = {
    "strings": ["0.5", "1"],
    "bools": [True, False],
    "nested": [[0.5]],
    "empty": None,  # no embedding at all
    "huge": [1e300, 1.0],  # finite: a float, past float32 (base64 cannot carry it)
}


class Vectors:
    """``"<word>"`` embeds as ``[len(word), 0.5, -1]``; a word of :data:`BAD` as its bad
    vector (what a user's stage might answer)."""

    def predict(self, items: list[Item]) -> list[Result]:
        out: list[Result] = []
        for item in items:
            text = item["text"]
            if text in BAD:
                vector = BAD[text]
                out.append({} if vector is None else {"embedding": vector})
            else:
                out.append({"embedding": [len(text), 0.5, -1.0]})
        return out


class Reverser:
    """Answers a prompt reversed (a completions stage without a model)."""

    def predict(self, items: list[Item]) -> list[Result]:
        return [{"generated_text": i["text"][::-1], "finish_reason": "stop"} for i in items]


VEC = Stage("vec", TextIn, runner="tests.gateway.test_hot_path_openai:Vectors", openai="embeddings")
TALK = Stage(
    "talk", GenerateIn, runner="tests.gateway.test_hot_path_openai:Reverser", openai="completions"
)

E, C, CHAT = "/v1/embeddings", "/v1/completions", "/v1/chat/completions"
# (path, body, whether the hot path takes it)
CASES: list[tuple[str, Any, bool] | tuple[str, Any, bool, dict[str, str]]] = [
    (E, {"model": "vec", "input": "a"}, True, {"X-Conveyor-Timeout": "5"}),
    (E, {"model": "vec", "input": "a"}, True, {"X-Conveyor-Priority": "bulk"}),
    (E, {"model": "vec", "input": "a"}, False, {"X-Conveyor-Timeout": "0.5e1"}),
    (E, {"model": "vec", "input": "a"}, False, {"X-Conveyor-Priority": "Bulk"}),
    (C, {"model": "talk", "prompt": "abc", "stream": True}, True),  # cannot stream: 400
    (C, {"model": "talk", "prompt": ["a", "b"], "stream": True}, True),  # one prompt: 400
    (E, {"model": "vec", "input": "a cat"}, True),
    (E, {"model": "vec", "input": ["a", "bb", "ccc"]}, True),
    (E, {"model": "vec", "input": "a cat", "encoding_format": "base64"}, True),
    (E, {"model": "vec", "input": "a", "user": "u1", "unknown": 3}, True),  # ignored
    (E, {"model": "vec", "input": "a", "dimensions": 2}, True),  # refused by the answer: 400
    (E, {"model": "vec", "input": {"text": "a"}}, True),  # refused by the answer: 400
    (E, {"model": "vec", "input": [1, 2, 3]}, True),  # token arrays: 400
    (E, {"model": "vec", "input": []}, True),
    (E, {"model": "vec", "input": "strings"}, True),  # the stage's bad answer: 502
    (E, {"model": "vec", "input": "huge", "encoding_format": "base64"}, True),  # 502
    (E, {"model": "vec", "input": "huge"}, True),  # finite: answered as floats
    (E, {"model": "nope", "input": "a"}, False),  # the route's 404
    (E, {"model": "talk", "input": "a"}, False),  # serves another route: the route's 400
    (E, {"model": "", "input": "a"}, False),
    (E, {"input": "a"}, False),
    (E, {"model": "vec", "input": "a", "encoding_format": "hex"}, False),
    (E, {"model": "vec", "input": "a", "dimensions": 0}, False),
    (E, [], False),
    (E, None, False),
    (C, {"model": "talk", "prompt": "abc"}, True),
    (C, {"model": "talk", "prompt": ["abc", "de"], "n": 2}, True),
    (C, {"model": "talk", "prompt": "abc", "echo": True}, True),  # refused by the answer
    (C, {"model": "talk", "prompt": "abc", "n": 9}, False),
    (C, {"model": "talk", "prompt": "abc", "max_tokens": 0}, False),
    (C, {"model": "vec", "prompt": "abc"}, False),
    (CHAT, {"model": "talk", "messages": [{"role": "user", "content": "hi"}]}, True),
    (CHAT, {"model": "talk", "messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, True),
    (CHAT, {"model": "talk", "messages": []}, False),
]


def pipelines() -> list[Pipeline]:
    """This file's stages, for real processes (``CONVEYOR_APP``)."""
    return [single(VEC), single(TALK)]


@pytest.fixture
async def served(harness: Harness) -> Any:
    for stage in (VEC, TALK):
        worker = harness.worker(stage, Vectors() if stage is VEC else Reverser())
        await worker.start()
        harness.run(worker)
    app = create_app(GatewaySettings(reply_block_ms=100), Registry([single(VEC), single(TALK)]))
    async with started(app) as http:
        yield app, http


def same(resp: httpx.Response) -> tuple[int, Any, set[str]]:
    """What a client sees (:func:`seen`), less a completion's own id and time."""
    status, body, headers = seen(resp)
    if isinstance(body, dict):
        body.pop("id", None)
        body.pop("created", None)
    return status, body, headers


async def test_the_hot_path_answers_the_openai_routes_as_they_do(served: Any) -> None:
    app, http = served
    calls = hot_path(app)
    for path, body, plain, *more in CASES:
        raw = orjson.dumps(body)
        headers = more[0] if more else {}
        hot, route, took = await both_ways(http, calls, path, raw, headers)
        assert took == plain, (path, body, hot.text)
        assert same(hot) == same(route), (path, body, hot.text, route.text)
        assert hot.status_code < 500 or hot.status_code == 502, (path, body, hot.text)
        if hot.status_code >= 400:  # OpenAI's shape, whoever answered
            assert set(hot.json()) == {"error"}, hot.text


async def test_what_the_hot_path_answers_is_the_routes_answer(served: Any) -> None:
    _, http = served
    one = (await http.post(E, json={"model": "vec", "input": "a cat"})).json()
    assert one["data"] == [{"object": "embedding", "index": 0, "embedding": [5.0, 0.5, -1.0]}]
    assert one["model"] == "vec"
    assert one["usage"]["prompt_tokens"] > 0
    packed = (
        await http.post(E, json={"model": "vec", "input": "ab", "encoding_format": "base64"})
    ).json()
    vector = struct.unpack("<3f", base64.b64decode(packed["data"][0]["embedding"]))
    assert vector == (2.0, 0.5, -1.0)
    talk = (await http.post(C, json={"model": "talk", "prompt": "abc"})).json()
    assert talk["choices"][0]["text"] == "cba"


@pytest.mark.parametrize("word", sorted(BAD))
@pytest.mark.parametrize("encoding", ["float", "base64"])
async def test_a_stage_answering_no_usable_embedding_is_a_502(
    served: Any, word: str, encoding: str
) -> None:
    # Before: the check looped in Python over every number (~0.2 ms a 384-vector), and a
    # finite number past float32's range raised OverflowError packing base64: a 500.
    _, http = served
    body = {"model": "vec", "input": ["fine", word], "encoding_format": encoding}
    resp = await http.post(E, json=body)
    if word == "huge" and encoding == "float":
        assert resp.status_code == 200, resp.text
        assert resp.json()["data"][1]["embedding"] == [1e300, 1.0]
        return
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["type"] == "server_error"
    assert "embedding" in error["message"], error


async def test_many_concurrent_hot_embeddings_each_get_their_own(served: Any) -> None:
    app, http = served
    calls = hot_path(app)
    before = calls.answered
    words = ["x" * (i + 1) for i in range(40)]
    answers = await asyncio.gather(
        *(http.post(E, json={"model": "vec", "input": [w, w + "y"]}) for w in words)
    )
    assert calls.answered == before + len(words)
    for word, resp in zip(words, answers, strict=True):
        data = resp.json()["data"]
        assert [d["embedding"][0] for d in data] == [len(word), len(word) + 1]


def test_a_hot_openai_call_is_traced_as_its_route(redis_url: str, tmp_path: Path) -> None:
    # Before: the hot path's admission named every root span after the pipeline
    # (POST /v1/vec), where the route names it after itself (POST /v1/embeddings).
    with receiver() as got:
        otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": got.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        app = {"CONVEYOR_APP": "tests.gateway.test_hot_path_openai:pipelines"}
        with GatewayProcess(redis_url, tmp_path / "gateway.log", **app, **otel) as gateway:
            worker = spawn(
                "workers",
                "vec",
                log=tmp_path / "worker.log",
                **app,
                CONVEYOR_REDIS_URL=redis_url,
                CONVEYOR_NAMESPACE=gateway.env["CONVEYOR_NAMESPACE"],
            )
            try:
                roots = {}
                for body in ({"model": "vec", "input": "a"}, {"text": "a"}):
                    path = E if "model" in body else "/v1/vec"
                    resp = httpx.post(f"{gateway.base}{path}", json=body, timeout=60)
                    assert resp.status_code == 200, resp.text
                    _, trace_id, root_id, _ = resp.headers["traceparent"].split("-")
                    spans = wait_for_spans(got, trace_id, {"admission", "enqueue", "reply"})
                    roots[path] = next(s for s in spans if s.span_id == root_id)
            finally:
                stop(worker)
    for path, root in roots.items():
        assert root.name == f"POST {path}", (path, root.name)
        assert root.attributes["http.route"] == path


def _text(rng: random.Random) -> str:
    """A text as a client might send one, or an odd one: empty, long, astral, control
    characters, RESP's own framing."""
    pools = ["a cat", "", "x" * rng.randint(1, 3000), "😀👍🏽", "\x00\r\n$5\r\n*2", "é" * 7, " "]
    return rng.choice(pools) + rng.choice(["", str(rng.randint(0, 10**6))])


def _value(rng: random.Random, depth: int = 0) -> Any:
    """Any JSON value, sometimes nested."""
    kind = rng.randint(0, 7 if depth < 3 else 4)
    if kind == 0:
        return _text(rng)
    if kind == 1:
        return rng.choice([0, -1, 2**63, -(2**64), 3.5, -0.0, 1e308, True, False, None])
    if kind == 2:
        return [_text(rng) for _ in range(rng.randint(0, 5))]
    if kind == 3:
        return rng.randint(-5, 3000)
    if kind == 4:
        return rng.choice(["float", "base64", "hex", "", None])
    if kind == 5:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {_text(rng)[:10]: _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _body(rng: random.Random) -> bytes:
    """A request body for one of the routes: mostly plausible, some fields wrong, some
    not JSON at all (raw bytes the wire refuses: NaN, 1e400, lone surrogates, bad UTF-8)."""
    roll = rng.random()
    if roll < 0.08:  # not a body the wire carries
        return rng.choice(
            [
                b"",
                b"{",
                b"null",
                b'{"model": "vec", "input": NaN}',
                b'{"model": "vec", "input": 1e400}',
                b'{"model": "vec", "input": "\\ud800"}',
                b'{"model": "vec", "input": "\xff"}',
                b"[" * 80 + b"]" * 80,
            ]
        )
    if roll < 0.5:  # plausible: mostly answered, by the hot path
        texts = [_text(rng) or "z" for _ in range(rng.randint(1, 5))]
        plausible: dict[str, Any] = {"model": "vec", "input": rng.choice([texts, texts[0]])}
        if rng.random() < 0.3:
            plausible["encoding_format"] = rng.choice(["float", "base64"])
        return json.dumps(plausible).encode()
    body: dict[str, Any] = {"model": rng.choice(["vec", "vec", "vec", "talk", "nope", "", 5])}
    for field, weight in (
        ("input", 0.9),
        ("encoding_format", 0.3),
        ("dimensions", 0.1),
        ("user", 0.1),
        ("prompt", 0.2),
        ("n", 0.1),
        ("messages", 0.1),
    ):
        if rng.random() < weight:
            body[field] = (
                _value(rng)
                if rng.random() < 0.3
                else (
                    [_text(rng) for _ in range(rng.randint(1, 4))]
                    if field == "input"
                    else _value(rng)
                )
            )
    return json.dumps(body).encode()  # the standard library writes ints past 64 bits


async def test_random_bodies_get_the_same_answer_from_both_paths_and_never_a_500(
    served: Any,
) -> None:
    # An attack on what the hot path now takes: 150 bodies, seeded, many invalid; each
    # sent to the hot path and to the route. Never a 500; every refusal in OpenAI's shape;
    # both paths answer alike; a 200's vectors are its own texts'.
    app, http = served
    rng = random.Random(37)
    calls = hot_path(app)
    took = 0
    statuses: dict[int, int] = {}
    for _ in range(150):
        raw = _body(rng)
        path = rng.choice([E, E, E, E, C, CHAT])
        hot, route, hot_took = await both_ways(http, calls, path, raw)
        took += hot_took
        assert same(hot) == same(route), (path, raw[:200], hot.text[:300], route.text[:300])
        assert hot.status_code in (200, 400, 404, 502), (path, raw[:200], hot.text[:300])
        statuses[hot.status_code] = statuses.get(hot.status_code, 0) + 1
        if hot.status_code != 200:
            assert set(hot.json()) == {"error"}, hot.text
        elif path == E:
            asked = json.loads(raw)
            texts = [asked["input"]] if isinstance(asked["input"], str) else asked["input"]
            got = [_first(d["embedding"]) for d in hot.json()["data"]]
            assert got == [float(len(t)) for t in texts], (raw[:200], got)
    assert statuses.get(200, 0) > 40, statuses  # a good share answered, and checked
    assert took > 40, took  # by the hot path itself


def _first(embedding: Any) -> float:
    """An embedding's first number, as floats or as OpenAI's base64 (float32)."""
    if isinstance(embedding, str):
        return float(struct.unpack_from("<f", base64.b64decode(embedding))[0])
    return float(embedding[0])


async def test_a_burst_of_random_valid_calls_each_get_their_own_vectors(served: Any) -> None:
    _, http = served
    rng = random.Random(38)
    bodies = [[_text(rng) or "z" for _ in range(rng.randint(1, 6))] for _ in range(60)]
    answers = await asyncio.gather(
        *(http.post(E, json={"model": "vec", "input": texts}) for texts in bodies)
    )
    for texts, resp in zip(bodies, answers, strict=True):
        assert resp.status_code == 200, resp.text
        assert [d["embedding"][0] for d in resp.json()["data"]] == [float(len(t)) for t in texts]


@pytest.mark.parametrize("on_connection", [True, False])
async def test_a_client_gone_from_a_hot_embeddings_call_cancels_each_of_its_texts(
    harness: Harness, redis: aioredis.Redis, on_connection: bool
) -> None:
    # No worker: the texts wait in the stream while the client goes away mid-call. The
    # call is answered on its connection (gateway/direct.py), or by the app's hot path
    # (a CORS request is the app's).
    waiting = Stage("waiting", TextIn, runner="unused", openai="embeddings")
    base = await harness.http_server([waiting])
    body = json.dumps({"model": "waiting", "input": ["one", "two", "three"]}).encode()
    origin = "" if on_connection else "Origin: http://elsewhere\r\n"
    head = f"POST /v1/embeddings HTTP/1.1\r\nContent-Type: application/json\r\n{origin}"
    writer = await raw_request(base, head, body)
    texts = [await queued(redis, harness, "waiting", nth) for nth in range(3)]
    assert sorted(r.payload["text"] for r in texts) == ["one", "three", "two"]
    assert watchers()  # the hot path's call waits, watching its client

    writer.close()
    await writer.wait_closed()

    async def all_cancelled() -> bool:
        marked = [await cancelled(redis, harness, r.id) for r in texts]
        return all(marked)

    await until(all_cancelled, 10)
    await until(_no_watchers, 10)
    direct = cast(GatewayApp, harness._servers[-1][0].config.app).on_connection
    assert direct is not None
    assert direct.answered == (1 if on_connection else 0)


async def _no_watchers() -> bool:
    return watchers() == []
