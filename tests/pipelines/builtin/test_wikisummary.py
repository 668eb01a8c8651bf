"""The reference workload end to end: wiki-summary against a MediaWiki stand-in."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from conveyor.embedded import free_port
from pipelines.builtin import builtin_pipelines
from pipelines.registry import Registry
from tests.helpers import REPO, Harness
from tests.support.fakewiki import FakeWiki

TURING = (
    "Alan Turing was an English mathematician and computer scientist. "
    "He was highly influential in the development of theoretical computer science. "
    "Turing is widely considered to be the father of artificial intelligence. "
    "He worked at Bletchley Park in England during the Second World War. "
    "His ideas on computation remain central to the field today."
)
PLAGUE = (
    "The Black Death was a horrible bubonic plague pandemic that killed millions. "
    "It caused terrible suffering, death and misery across Europe. "
    "Whole towns were destroyed and the survivors lived in fear and grief."
)


@pytest.fixture
def wiki(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeWiki]:
    with FakeWiki() as fake:
        fake.add("Alan Turing", TURING)
        fake.add("Black Death", PLAGUE)
        fake.add("Long Article", (TURING + "\n") * 20_000)  # ~6 MB before the cut
        monkeypatch.setenv("CONVEYOR_WIKIPEDIA_API_URL", fake.api_url)
        monkeypatch.setenv("CONVEYOR_WIKIPEDIA_TIMEOUT_S", "5")
        yield fake


@pytest.fixture
async def http(harness: Harness, wiki: FakeWiki) -> httpx.AsyncClient:
    return await harness.serve(Registry(builtin_pipelines()).select(["wiki-summary"]))


async def test_summary_and_entities_of_a_positive_article(
    http: httpx.AsyncClient, wiki: FakeWiki
) -> None:
    resp = await http.get("/v1/wiki-summary", params={"search_term": "turing"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"title", "url", "summary", "entities", "sentiment"}
    assert body["title"] == "Alan Turing"
    assert body["url"] == "https://en.wikipedia.org/wiki/Alan_Turing"
    assert body["sentiment"]["label"] == "POSITIVE"
    assert 0 < len(body["summary"]) < len(TURING)
    assert all(s.strip(". ") in TURING for s in body["summary"].split(". "))
    assert isinstance(body["entities"], list)
    assert wiki.requests_received >= 3  # the real client ran against the stand-in


async def test_negative_article_is_rejected_before_summarize_and_ner(
    http: httpx.AsyncClient, harness: Harness
) -> None:
    resp = await http.post("/v1/wiki-summary", json={"search_term": "black death"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["rejected"] is True
    assert "negative sentiment" in body["reason"]
    assert body["title"] == "Black Death"
    assert (await harness.stats("sentiment"))["items:ok"] == 1
    assert await harness.stats("summarize") == {}
    assert await harness.stats("ner") == {}
    assert await harness.stats("wiki-summary.combine") == {}


async def test_unknown_term_is_404(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/wiki-summary", json={"search_term": "xyzzy plugh"})
    assert resp.status_code == 404
    assert "no Wikipedia article matches 'xyzzy plugh'" in resp.json()["detail"]


async def test_very_long_article_is_cut_to_the_models_limits(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/wiki-summary", json={"search_term": "long article"}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["title"] == "Long Article"
    assert len(resp.json()["summary"]) < 2_000


async def test_wikipedia_unreachable_is_503_not_a_hang(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONVEYOR_WIKIPEDIA_API_URL", f"http://127.0.0.1:{free_port()}/w/api.php")
    http = await harness.serve(Registry(builtin_pipelines()).select(["wiki-summary"]))
    resp = await http.post("/v1/wiki-summary", json={"search_term": "turing"})
    assert resp.status_code == 503
    assert "unreachable" in resp.json()["detail"]
    assert resp.headers["retry-after"]


async def test_wikipedia_hanging_is_503_after_the_fetch_timeout(
    harness: Harness, wiki: FakeWiki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONVEYOR_WIKIPEDIA_TIMEOUT_S", "0.5")
    wiki.hang = True
    http = await harness.serve(Registry(builtin_pipelines()).select(["wiki-summary"]))
    resp = await http.post("/v1/wiki-summary", json={"search_term": "turing"})
    assert resp.status_code == 503
    assert "did not answer within 0.5 s" in resp.json()["detail"]


def test_a_bad_wikipedia_setting_stops_the_fetch_worker_at_start(redis_url: str) -> None:
    # Only the worker serving the fetch step reads CONVEYOR_WIKIPEDIA_*: it refuses to start,
    # naming the setting, instead of failing every request later (and serving on forever).
    env = dict(os.environ) | {
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "CONVEYOR_REDIS_URL": redis_url,
        "CONVEYOR_NAMESPACE": f"wikibad{os.getpid()}",
        "CONVEYOR_WIKIPEDIA_TIMEOUT_S": "soon",
    }
    argv = [sys.executable, "-m", "workers", "wiki-summary.fetch"]
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "CONVEYOR_WIKIPEDIA_TIMEOUT_S" in done.stderr, done.stderr[-800:]
