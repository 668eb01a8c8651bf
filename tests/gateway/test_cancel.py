"""Cancellation at the gateway: a client that goes away cancels its request, and an async
job's owner cancels it with ``DELETE /v1/jobs/{id}``. Real uvicorn, real sockets, real Redis:
"cancelled" is the request's marker in Redis (``Keys.cancelled``), which workers honour."""

from __future__ import annotations

import asyncio
import threading
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import redis.asyncio as aioredis
from starlette.types import Message, Receive, Scope, Send

from conveyor.embedded import free_port, start_redis
from gateway import cancel
from gateway.app import create_app
from gateway.cancel import WATCHING, Watch
from gateway.protocol import Disconnect
from gateway.routes.pipelines import reply_response
from gateway.settings import GatewaySettings
from pipelines.envelope import Reply, Request, decode_request
from pipelines.errors import Cancelled
from pipelines.graph import single
from pipelines.model import Model
from pipelines.outcomes import Outcome
from pipelines.registry import Registry
from pipelines.stages import GenerateIn, Stage
from runtime.jobs import CANCEL_GRACE_S
from tests.gateway.test_streaming_jobs import Gated
from tests.helpers import Doubler, Harness, number_stage, until

KEY_A = "alpha-secret-key"
KEY_B = "bravo-secret-key"


class Held(Gated):
    """:class:`Gated`, a batch at a time: each batch waits for a release of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Semaphore(0)

    def release(self, batches: int = 1) -> None:
        """Let ``batches`` held batches (now or to come) finish."""
        self.gate.release(batches)

    def hold(self) -> None:
        self.gate.acquire(timeout=30)


def held_stage() -> Stage:
    # One required string field: POST, GET ?text= and /stream routes.
    return Stage("held", GenerateIn, runner="unused", streaming=True)


async def serve(harness: Harness, stage: Stage, model: Model) -> str:
    """A running worker of ``stage`` on ``model`` (no batch window), and a gateway on
    loopback routing it: its base URL."""
    worker = harness.worker(stage, model, batch_wait_ms=0)
    await worker.start()
    harness.run(worker)
    return await harness.http_server([stage])


async def requests_in(redis: aioredis.Redis, harness: Harness, stage: str) -> list[Request]:
    """The requests on ``stage``'s stream, oldest first."""
    entries = await redis.xrange(harness.keys.stage_stream(stage)) or []
    return [decode_request(fields or {}) for _, fields in entries]


async def queued(redis: aioredis.Redis, harness: Harness, stage: str, nth: int = 0) -> Request:
    """The ``nth`` request to reach ``stage``'s stream (waiting for it)."""

    async def arrived() -> bool:
        return len(await requests_in(redis, harness, stage)) > nth

    await until(arrived, 10)
    return (await requests_in(redis, harness, stage))[nth]


async def cancelled(redis: aioredis.Redis, harness: Harness, request_id: str) -> bool:
    """Whether ``request_id``'s cancellation marker is set."""
    return bool(await redis.exists(harness.keys.cancelled(request_id)))


async def raw_request(
    base: str, head: str, body: bytes = b"", pause_s: float = 0.0
) -> asyncio.StreamWriter:
    """Send one HTTP/1.1 request on a fresh connection (its body ``pause_s`` after its
    headers, in one write); returns it, left open."""
    url = urlsplit(base)
    _, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(head.encode() + f"Host: gw\r\nContent-Length: {len(body)}\r\n\r\n".encode())
    if pause_s:
        await writer.drain()
        await asyncio.sleep(pause_s)
    writer.write(body)
    await writer.drain()
    return writer


def watchers() -> list[Watch]:
    """The gateway's disconnect watches not stopped yet (the gateway runs on this loop),
    of either kind: a hook on the protocol's Disconnect, or a task reading receive."""
    return list(WATCHING)


async def answered(http: httpx.AsyncClient, status: int) -> bool:
    """Whether the gateway's metrics count a ``/v1/held`` answer with ``status``."""
    metrics = (await http.get("/metrics")).text
    return f'conveyor_http_requests_total{{route="/v1/held",status="{status}"}}' in metrics


POST_HELD = "POST /v1/held HTTP/1.1\r\nContent-Type: application/json\r\n"
GET_HELD = "GET /v1/held?text=hi HTTP/1.1\r\n"
LARGE = b'{"text": "%s"}' % (b"x" * 99_000)


@pytest.mark.parametrize(
    ("head", "body", "pause_s"),
    [
        (POST_HELD, b'{"text": "hi"}', 0.0),
        (GET_HELD, b"", 0.0),
        # Past uvicorn's 64 KiB in one read, after the headers: it pauses reading.
        (POST_HELD, LARGE, 0.2),
        # A body the route never reads (a GET's), past 64 KiB: dropped, not paused on.
        (GET_HELD, b"y" * 200_000, 0.0),
    ],
    ids=["post", "get", "post-large", "get-unread-body"],
)
async def test_a_sync_client_that_disconnects_cancels_its_request(
    harness: Harness, redis: aioredis.Redis, head: str, body: bytes, pause_s: float
) -> None:
    """Large bodies too, read or not: the client's going is seen."""
    base = await harness.http_server([held_stage()])  # no worker: the request waits
    writer = await raw_request(base, head, body, pause_s)
    request = await queued(redis, harness, "held")
    assert not await cancelled(redis, harness, request.id)
    # The handler waits, watching its client: by a hook the server's protocol runs when
    # the connection is lost, not a task of its own.
    (watching,) = watchers()
    assert watching.task is None
    assert watching.disconnect is not None
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("disconnect-watch-")]

    writer.close()
    await writer.wait_closed()

    await until(lambda: cancelled(redis, harness, request.id), 10)
    # It lasts past the request's deadline (30 s, the default), never forever.
    ttl = await redis.ttl(harness.keys.cancelled(request.id))
    assert 30 < ttl <= 30 + CANCEL_GRACE_S + 1
    async with httpx.AsyncClient(base_url=base) as http:
        # The handler stopped waiting at once (499, long before its 30 s deadline).
        await until(lambda: answered(http, 499), 10)
    assert watchers() == []


async def test_a_completed_call_leaves_no_marker_and_no_watcher(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage(batch_wait_ms=0)
    base = await serve(harness, stage, Doubler())
    async with httpx.AsyncClient(base_url=base) as http:
        for value in range(3):  # one kept-alive connection: each request its own watcher
            resp = await http.post("/v1/double", json={"value": value})
            assert resp.status_code == 200, resp.text
            assert resp.json() == {"value": 2 * value}
            assert watchers() == []
            assert not await cancelled(redis, harness, resp.headers["X-Request-Id"])
    assert await redis.keys(harness.keys.cancelled("*")) == []

    # The watcher is stopped by its handler, before the answer goes out: not left to end
    # when the server happens to say the response is complete.
    app = create_app(GatewaySettings(reply_block_ms=100), Registry([single(stage)]))
    alive_at_answer: list[int] = []

    async def spy(scope: Scope, receive: Receive, send: Send) -> None:
        async def spying(message: Message) -> None:
            if message["type"] == "http.response.start":
                alive_at_answer.append(len(watchers()))
            await send(message)

        await app(scope, receive, spying)

    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=spy), base_url="http://gw") as http,
    ):
        assert (await http.post("/v1/double", json={"value": 1})).json() == {"value": 2}
    assert alive_at_answer == [0]


async def test_redis_down_when_marking_is_a_warning_not_an_error(
    harness: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    proc = start_redis(port, tmp_path / "redis")
    try:
        own = f"redis://127.0.0.1:{port}/0"
        base = await harness.http_server([held_stage()], redis_url=own, redis_timeout_s=0.5)
        writer = await raw_request(
            base, "POST /v1/held HTTP/1.1\r\nContent-Type: application/json\r\n", b'{"text": "a"}'
        )
        client = aioredis.Redis.from_url(own)
        try:
            await queued(client, harness, "held")
        finally:
            await client.aclose()
    finally:
        proc.kill()
        proc.wait(timeout=10)
    writer.close()
    await writer.wait_closed()
    async with httpx.AsyncClient(base_url=base) as http:
        await until(lambda: answered(http, 499), 10)  # answered, nothing raised
    warned = [r.getMessage() for r in caplog.records if r.name == "gateway.cancel"]
    assert any("not cancelled, redis unreachable" in m for m in warned), warned
    assert not [r for r in caplog.records if r.name.startswith("uvicorn")], caplog.text
    assert watchers() == []


async def test_a_stream_client_that_disconnects_cancels_its_request(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = held_stage()
    model = Held()
    base = await serve(harness, stage, model)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            async with http.stream("POST", "/v1/held/stream", json={"text": "hi"}) as resp:
                assert resp.status_code == 200
                request_id = resp.headers["X-Request-Id"]
                lines = resp.aiter_lines()
                assert await anext(lines) == "event: token"  # the generation is under way
                assert not await cancelled(redis, harness, request_id)
            # Leaving the block closes the stream before its last event.
            await until(lambda: cancelled(redis, harness, request_id), 10)

            # A stream read to its end leaves no marker.
            model.release(2)  # the abandoned one's batch, and this one's
            async with http.stream("POST", "/v1/held/stream", json={"text": "hi"}) as resp:
                events = [line async for line in resp.aiter_lines() if line.startswith("event")]
                request_id = resp.headers["X-Request-Id"]
            assert events == ["event: token", "event: token", "event: done"]
            assert not await cancelled(redis, harness, request_id)
    finally:
        model.release(10)


async def test_a_stream_abandoned_before_its_first_event_is_cancelled(
    harness: Harness, redis: aioredis.Redis
) -> None:
    base = await harness.http_server([held_stage()])  # no worker: no event ever comes
    writer = await raw_request(
        base,
        "POST /v1/held/stream HTTP/1.1\r\nContent-Type: application/json\r\n",
        b'{"text": "a"}',
    )
    request = await queued(redis, harness, "held")
    writer.close()
    await writer.wait_closed()
    await until(lambda: cancelled(redis, harness, request.id), 10)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_delete_cancels_a_queued_job_for_its_owner_only(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage(batch_wait_ms=0)
    http = await harness.gateway([stage], api_keys=[KEY_A, KEY_B])  # no worker yet
    resp = await http.post("/v1/jobs/double", json={"value": 4}, headers=bearer(KEY_A))
    job_id = resp.json()["id"]

    # Another key's job is exactly an unknown one, and nothing is marked.
    unknown = await http.delete("/v1/jobs/no-such-job", headers=bearer(KEY_A))
    assert unknown.status_code == 404, unknown.text
    other = await http.delete(f"/v1/jobs/{job_id}", headers=bearer(KEY_B))
    assert other.status_code == 404, other.text
    assert other.json() == {"detail": unknown.json()["detail"].replace("no-such-job", job_id)}
    assert not await cancelled(redis, harness, job_id)
    assert (await http.delete(f"/v1/jobs/{job_id}")).status_code == 401

    done = await http.delete(f"/v1/jobs/{job_id}", headers=bearer(KEY_A))
    assert done.status_code == 200, done.text
    view = {
        "id": job_id,
        "pipeline": "double",
        "status": "cancelled",
        "error": "cancelled",
        "http_status": 499,
    }
    assert done.json() == view
    assert await cancelled(redis, harness, job_id)
    assert (await http.get(f"/v1/jobs/{job_id}", headers=bearer(KEY_A))).json() == view
    # The record is kept as a finished job's is (it does not outlive its TTL).
    assert await redis.ttl(harness.keys.job(job_id)) > 0

    again = await http.delete(f"/v1/jobs/{job_id}", headers=bearer(KEY_A))
    assert again.status_code == 409, again.text
    assert again.json()["job"] == view
    assert again.json()["request_id"] == job_id
    assert "already finished (cancelled)" in again.json()["detail"]


async def test_delete_of_a_finished_job_is_409_with_the_job(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage(batch_wait_ms=0)
    http = await harness.gateway([stage])
    job_id = (await http.post("/v1/jobs/double", json={"value": 4})).json()["id"]
    await harness.worker(stage, Doubler()).run(burst=True)
    done = await http.delete(f"/v1/jobs/{job_id}")
    assert done.status_code == 409, done.text
    assert done.headers["X-Request-Id"] == job_id
    assert done.json()["job"] == {
        "id": job_id,
        "pipeline": "double",
        "status": "done",
        "result": {"value": 8},
    }
    assert not await cancelled(redis, harness, job_id)
    assert (await http.get(f"/v1/jobs/{job_id}")).json()["status"] == "done"

    # One queued past its deadline is expired: finished too.
    late = (
        await http.post(
            "/v1/jobs/double", json={"value": 1}, headers={"X-Conveyor-Timeout": "0.05"}
        )
    ).json()["id"]
    await asyncio.sleep(0.1)  # the deadline is the condition: it has to pass
    expired = await http.delete(f"/v1/jobs/{late}")
    assert expired.status_code == 409, expired.text
    assert expired.json()["job"]["status"] == "expired"


async def test_delete_with_redis_down_is_503(harness: Harness) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    http = await harness.gateway([number_stage()], redis_url=dead, redis_timeout_s=0.5)
    resp = await http.delete("/v1/jobs/some-job")
    assert resp.status_code == 503
    assert "retry-after" in resp.headers


def test_a_cancelled_reply_answers_499() -> None:
    # Should a worker answer a waiting call "cancelled": 499, as a cancelled job says.
    reply = Reply(id="r1", stage="double", outcome=Outcome.CANCELLED, error="cancelled")
    with pytest.raises(Cancelled) as raised:
        reply_response(reply, "r1")
    assert raised.value.status == 499
    assert raised.value.request_id == "r1"


async def test_a_watch_without_the_protocol_is_a_task_and_ends_with_its_call(
    harness: Harness,
) -> None:
    """Served without conveyor's protocol (an ASGI transport, another server), a call
    watches its client with a task reading receive, stopped when the call ends."""
    stage = number_stage(batch_wait_ms=0)
    worker = harness.worker(stage, Doubler())
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([stage])
    kinds: list[bool] = []
    watch_of = cancel.watch

    def spying(*args: Any) -> Watch:
        found = watch_of(*args)
        kinds.append(found.task is not None)
        return found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("gateway.service.watch", spying)
        resp = await http.post("/v1/double", json={"value": 4})
    assert resp.json() == {"value": 8}
    assert kinds == [True]
    assert watchers() == []


def test_a_disconnect_runs_each_hook_once_and_a_late_one_at_once() -> None:
    resumed: list[bool] = []
    disconnect = Disconnect(lambda: resumed.append(True))
    ran: list[str] = []
    disconnect.add(lambda: ran.append("a"))
    kept = partial(ran.append, "b")
    disconnect.add(kept)
    dropped = partial(ran.append, "dropped")
    disconnect.add(dropped)
    disconnect.discard(dropped)
    disconnect.discard(dropped)  # twice: nothing to do
    assert resumed == [True, True, True]  # a lost connection shows only to a read
    assert ran == []
    disconnect.run()
    disconnect.run()  # lost once
    assert ran == ["a", "b"]
    disconnect.add(partial(ran.append, "late"))  # the client went before it was watched
    assert ran == ["a", "b", "late"]


async def test_a_stopped_watch_is_not_run_by_a_later_disconnect() -> None:
    disconnect = Disconnect(lambda: None)
    waiting: asyncio.Future[object] = asyncio.get_running_loop().create_future()

    async def never() -> Message:
        raise AssertionError("a watch on the protocol's Disconnect reads nothing")

    found = cancel.watch(never, waiting, "r1", disconnect)
    assert found.task is None
    assert disconnect.watched
    await cancel.unwatch(found)
    assert not disconnect.watched
    assert found not in WATCHING
    disconnect.run()
    assert not waiting.done()  # stopped: the later loss is not its


def test_a_failing_hook_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    disconnect = Disconnect(lambda: None)
    ran: list[str] = []

    def fails() -> None:
        raise RuntimeError("boom")

    disconnect.add(fails)
    disconnect.add(partial(ran.append, "after"))
    disconnect.run()
    assert ran == ["after"]
    assert "a disconnect hook failed" in caplog.text
