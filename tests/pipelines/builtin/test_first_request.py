"""``ready`` means ready: for every built-in pipeline, the first request after its workers
have started is about as fast as the ones after it (every path a request takes ran once
at load: see workers/build.py and workers/models/decoder.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pipelines.builtin import DEFAULT_UP, builtin_pipelines
from pipelines.registry import Registry
from tests.helpers import Harness
from tests.support.fakewiki import FakeWiki

WARM_REQUESTS = 5
TEXT = "Ada Lovelace met Charles Babbage in London. They wrote about the engine at length."
PAYLOADS: dict[str, dict[str, Any]] = {
    "embed": {"text": TEXT},
    "sentiment": {"text": TEXT},
    "ner": {"text": TEXT},
    "summarize": {"text": TEXT},
    # Sampled and streamed paths are warmed as well as greedy: the test sends the most
    # demanding of them (sampling, a prompt of a few dozen tokens).
    "generate": {"text": TEXT, "max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9},
    "echo": {"text": TEXT},
    "chain": {"value": 5},
    "broadcast": {"value": 5},
    "hello": {"language": "spanish", "name": "Ada"},
    "wiki-summary": {"search_term": "turing"},
}


@pytest.fixture
def wiki(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeWiki]:
    with FakeWiki() as fake:
        fake.add("Alan Turing", TEXT)
        monkeypatch.setenv("CONVEYOR_WIKIPEDIA_API_URL", fake.api_url)
        yield fake


def test_every_builtin_pipeline_is_checked() -> None:
    assert set(PAYLOADS) == {*DEFAULT_UP, "echo"}


@pytest.mark.parametrize("pipeline", sorted(PAYLOADS))
async def test_the_first_request_after_ready_is_warm(
    harness: Harness, wiki: FakeWiki, pipeline: str
) -> None:
    # In this process, as the harness starts workers: each pipeline's workers start
    # (models loaded, warmed) before the gateway takes the first request.
    http = await harness.serve(Registry(builtin_pipelines()).select([pipeline]))
    path = f"/v1/{pipeline}/stream" if pipeline == "generate" else f"/v1/{pipeline}"
    times = [await _timed(http, path, PAYLOADS[pipeline]) for _ in range(1 + WARM_REQUESTS)]
    first, median = times[0], statistics.median(times[1:])
    # The bound is 3x the warm median; the half-second floor keeps a shared
    # 2-core CI machine's hiccups (a warm request of a few ms) from failing it.
    assert first <= max(3 * median, median + 0.5), (pipeline, times)


async def _timed(http: httpx.AsyncClient, path: str, payload: dict[str, Any]) -> float:
    started = time.perf_counter()
    resp = await http.post(path, json=payload)
    took = time.perf_counter() - started
    assert resp.status_code == 200, resp.text
    return took
