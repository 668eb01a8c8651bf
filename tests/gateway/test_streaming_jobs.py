"""Server-Sent Events from a streaming model, and async jobs that outlive a gateway."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import pytest

from gateway.routes.pipelines import Relay
from pipelines.envelope import Reply
from pipelines.graph import single
from pipelines.model import Item, Result
from pipelines.outcomes import Outcome
from pipelines.registry import Registry
from pipelines.stages import BUILTIN, GenerateIn, Stage
from tests.helpers import Doubler, Harness, number_stage, read_sse, until


class Gated:
    """Streams one word, then waits for the test's go-ahead before streaming the rest."""

    def __init__(self) -> None:
        self.go = threading.Event()

    def hold(self) -> None:
        """Wait for the go-ahead."""
        assert self.go.wait(30), "the client never saw the first token"

    def predict(self, items: list[Item]) -> list[Result]:
        return [{"generated_text": "one two"} for _ in items]

    def predict_stream(
        self, items: list[Item], emit: Callable[[int, str], None]
    ) -> Sequence[Result | BaseException]:
        for i in range(len(items)):
            emit(i, "one")
        self.hold()
        for i in range(len(items)):
            emit(i, "one two")
        return self.predict(items)


async def test_first_token_reaches_the_client_before_generation_ends(harness: Harness) -> None:
    stage = Stage("gated", GenerateIn, runner="unused", streaming=True)
    model = Gated()
    worker = harness.worker(stage, model)
    await worker.start()
    harness.run(worker)
    base = await harness.http_server([stage])
    async with (
        httpx.AsyncClient(base_url=base, timeout=30) as http,
        http.stream("POST", "/v1/gated/stream", json={"text": "hi"}) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        # the model only finishes once the first event has arrived here
        events = await read_sse(resp, model.go.set)
    assert events == [
        ("token", {"text": "one"}),
        ("token", {"text": " two"}),
        ("done", {"generated_text": "one two"}),
    ]


@pytest.mark.parametrize("decoding", ["static", "continuous"])
async def test_batched_generation_streams_each_request_its_own_tokens(
    harness: Harness, decoding: str
) -> None:
    stage = BUILTIN["generate"]
    worker = harness.worker(
        stage, device="cpu", batch_wait_ms=200, adaptive_batching=False, decoding=decoding
    )
    await worker.start()
    harness.run(worker)
    base = await harness.http_server([stage])
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:

        async def one(prompt: str) -> list[tuple[str, Any]]:
            body = {"text": prompt, "max_new_tokens": 12}
            async with http.stream("POST", "/v1/generate/stream", json=body) as resp:
                return await read_sse(resp)

        results = await asyncio.gather(*(one(f"story number {i}") for i in range(3)))

    async def recorded() -> bool:  # a batch is recorded once its publish call returns,
        return bool(worker.history)  # which may be after its clients have their answers

    await until(recorded, 10)
    if decoding == "static":  # one batch served all three streams
        assert max(r.size for r in worker.history) == 3
    for events in results:
        *tokens, (last, final) = events
        assert last == "done"
        assert tokens
        assert all(kind == "token" for kind, _ in tokens)
        assert "".join(t["text"] for _, t in tokens) == final["generated_text"]


async def test_stream_refusals_are_plain_http_errors(harness: Harness) -> None:
    stage = Stage("gated", GenerateIn, runner="unused", streaming=True)
    http = await harness.gateway([stage], max_backlog=1, admission_refresh_ms=0)
    await harness.enqueue("gated", [{"text": "queued"}])
    resp = await http.post("/v1/gated/stream", json={"text": "x"})
    assert resp.status_code == 503
    resp = await http.post("/v1/gated/stream", json={"text": ""})
    assert resp.status_code == 422


async def test_job_result_matches_the_sync_call(harness: Harness) -> None:
    stage = number_stage(batch_wait_ms=0)
    http = await harness.gateway([stage])
    resp = await http.post("/v1/jobs/double", json={"value": 4})
    assert resp.status_code == 202
    job_id = resp.json()["id"]
    assert resp.headers["location"] == f"/v1/jobs/{job_id}"
    worker = harness.worker(stage, Doubler())
    await worker.run(burst=True)  # the job is done once this returns
    harness.run(worker)
    sync = (await http.post("/v1/double", json={"value": 4})).json()
    body = (await http.get(f"/v1/jobs/{job_id}")).json()
    assert body == {"id": job_id, "pipeline": "double", "status": "done", "result": sync}


async def test_job_survives_a_gateway_restart(harness: Harness) -> None:
    stage = number_stage(batch_wait_ms=0)
    registry = Registry([single(stage)])
    first = await harness.gateway(registry)
    job_id = (await first.post("/v1/jobs/double", json={"value": 21})).json()["id"]
    assert (await first.get(f"/v1/jobs/{job_id}")).json()["status"] == "queued"
    await harness.close_gateways()  # the gateway that took the job is gone
    await harness.worker(stage, Doubler()).run(burst=True)
    second = await harness.gateway(registry)
    body = (await second.get(f"/v1/jobs/{job_id}")).json()
    assert body["status"] == "done"
    assert body["result"] == {"value": 42}


async def test_failed_and_unknown_jobs(harness: Harness) -> None:
    stage = number_stage(batch_wait_ms=0)
    http = await harness.gateway([stage])
    job_id = (await http.post("/v1/jobs/double", json={"value": 1, "fail": True})).json()["id"]
    await harness.worker(stage, Doubler()).run(burst=True)
    body = (await http.get(f"/v1/jobs/{job_id}")).json()
    assert body["status"] == "failed"
    assert body["http_status"] == 500
    assert "poisoned item" in body["error"]
    resp = await http.get("/v1/jobs/nope")
    assert resp.status_code == 404
    assert (await http.post("/v1/jobs/double", json={"value": "x"})).status_code == 422


async def test_the_relay_sends_each_piece_once_and_never_skips_ahead_on_an_offset() -> None:
    # Partials say where their text starts (``at``). A worker that takes a request over
    # streams again from the start: what the client has is skipped. An offset past what
    # was sent (a lost partial, or one forged on the reply stream) is passed on whole and
    # never moves the count ahead: the text after it still reaches the client. Each stage
    # of a pipeline counts its own text.
    def part(text: str, at: int, stage: str = "gen") -> Reply:
        return Reply(id="r", stage=stage, outcome="partial", result={"text": text, "at": at})

    queue: asyncio.Queue[Reply] = asyncio.Queue()
    for reply in [
        part("ab", 0),
        part("cd", 2),
        part("abc", 0),  # the new worker's first pieces: all seen
        part("def", 3),  # half seen
        part("X", 10**18),  # forged
        part("gh", 6),
        part("zz", 0, stage="next"),  # the next stage's own text
        Reply(id="r", stage="next", outcome=Outcome.OK, result={"done": True}),
    ]:
        queue.put_nowait(reply)
    got = [r.result for r in [r async for r in Relay(queue, 10).replies()] if r is not None]
    assert got == [
        {"text": "ab"},
        {"text": "cd"},
        {"text": "ef"},
        {"text": "X"},
        {"text": "gh"},
        {"text": "zz"},
        {"done": True},
    ]
