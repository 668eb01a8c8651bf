"""Each built-in stage answers with the right shape, through HTTP, with its real runner."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from pipelines.stages import BUILTIN
from tests.helpers import Harness


@pytest.fixture
async def http(harness: Harness) -> httpx.AsyncClient:
    stages = [BUILTIN[name] for name in ("embed", "sentiment", "ner", "summarize", "generate")]
    workers = [harness.worker(s, device="cpu", threads=1) for s in stages]
    await asyncio.gather(*(w.start() for w in workers))  # loads every model once
    for w in workers:
        harness.run(w)
    return await harness.gateway(stages)


async def test_embed(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/embed", json={"text": "A cat sat on the mat."})
    assert resp.status_code == 200, resp.text
    vec = resp.json()["embedding"]
    assert len(vec) == 384
    assert math.isclose(sum(v * v for v in vec), 1.0, rel_tol=1e-4)


async def test_sentiment_by_get(http: httpx.AsyncClient) -> None:
    resp = await http.get("/v1/sentiment", params={"text": "What a lovely day"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["label"] in {"POSITIVE", "NEGATIVE"}
    assert 0.0 <= body["score"] <= 1.0


async def test_ner(http: httpx.AsyncClient) -> None:
    text = "Ada Lovelace met Charles Babbage in London."
    resp = await http.post("/v1/ner", json={"text": text})
    assert resp.status_code == 200, resp.text
    entities = resp.json()["entities"]
    assert isinstance(entities, list)
    for e in entities:
        assert set(e) == {"word", "entity_group", "score", "start", "end"}
        assert e["entity_group"] in {"PER", "ORG", "LOC", "MISC"}
        assert text[e["start"] : e["end"]] == e["word"]


async def test_summarize_keeps_sentences_of_the_text(http: httpx.AsyncClient) -> None:
    sentences = [
        "The city council approved the new budget on Monday.",
        "Funding for public parks rises by ten percent.",
        "My neighbour's cat is called Biscuit.",
        "Road repairs also receive more money under the budget.",
        "The council will vote on school funding next month.",
    ]
    resp = await http.post("/v1/summarize", json={"text": " ".join(sentences)})
    assert resp.status_code == 200, resp.text
    summary = resp.json()["summary"]
    kept = [s for s in sentences if s in summary]
    assert 1 <= len(kept) <= 3
    assert len(summary) < len(" ".join(sentences))


async def test_generate_batches_requests(http: httpx.AsyncClient) -> None:
    resps = await asyncio.gather(
        *(
            http.post("/v1/generate", json={"text": f"Once upon a time {i}", "max_new_tokens": 4})
            for i in range(4)
        )
    )
    for resp in resps:
        assert resp.status_code == 200, resp.text
        assert isinstance(resp.json()["generated_text"], str)
    resp = await http.post("/v1/generate", json={"text": "x", "max_new_tokens": 0})
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"] == ["body", "max_new_tokens"]
