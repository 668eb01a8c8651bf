"""The Python client against a real gateway (uvicorn on loopback), real workers and Redis.

The sync :class:`Client` blocks, so its calls run in a thread: the gateway serves on this
test's event loop. The flows both clients run (``conveyor._flows``) are also driven here
without a network, against scripted answers, to pin down their retry and polling decisions.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from conveyor._flows import Flow, Map, Post, Sleep
from conveyor.client import AsyncClient, Client, ConveyorHTTPError
from conveyor.embedded import free_port
from pipelines.envelope import decode_request
from pipelines.model import Item, Result
from pipelines.stages import BUILTIN, GenerateIn, Stage
from tests.gateway.test_cancel import Held, cancelled, held_stage, queued, serve
from tests.helpers import Doubler, Harness, number_stage, until


class Recording(httpx.AsyncHTTPTransport):
    """The network, noting what each attempt got: a status, or None for no answer."""

    def __init__(self) -> None:
        super().__init__()
        self.statuses: list[int | None] = []
        self.requests: list[httpx.Request] = []
        self.refused = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        try:
            resp = await super().handle_async_request(request)
        except httpx.TransportError:
            self.statuses.append(None)
            raise
        self.statuses.append(resp.status_code)
        if resp.status_code == 503:
            self.refused.set()
        return resp


class CountingSync(httpx.HTTPTransport):
    """The network, counting the attempts of a sync client (and keeping their requests)."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts = 0
        self.requests: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.attempts += 1
        self.requests.append(request)
        return super().handle_request(request)


class Broken:
    """Streams one word, then fails every item."""

    def predict(self, items: list[Item]) -> list[Result | BaseException]:
        return [ValueError("out of words") for _ in items]

    def predict_stream(
        self, items: list[Item], emit: Callable[[int, str], None]
    ) -> Sequence[Result | BaseException]:
        for i in range(len(items)):
            emit(i, "once")
        return self.predict(items)


async def doubling(harness: Harness, **stage: Any) -> tuple[str, Doubler]:
    """A gateway on loopback and a running worker for ``double``."""
    model = Doubler()
    worker = harness.worker(number_stage(**stage), model)
    await worker.start()
    harness.run(worker)
    return await harness.http_server([number_stage(**stage)]), model


async def test_call_with_a_payload_or_keywords(harness: Harness) -> None:
    base, _ = await doubling(harness, batch_wait_ms=0)

    def sync_calls() -> list[dict[str, Any]]:
        with Client(base) as client:
            return [
                client.call("double", {"value": 2}),
                client.call("double", value=3),
                client.call("double", {"value": 1}, value=5),  # keywords win
            ]

    assert await asyncio.to_thread(sync_calls) == [{"value": 4}, {"value": 6}, {"value": 10}]
    network = Recording()
    async with AsyncClient(base, api_key="k1", transport=network) as client:
        assert await client.call("double", {"value": 7}) == {"value": 14}
        assert await client.call("double", value=8, timeout=5, trace_id="t-42") == {"value": 16}
    first, second = network.requests
    assert first.headers["authorization"] == "Bearer k1"
    assert "x-conveyor-timeout" not in first.headers
    assert second.headers["x-conveyor-timeout"] == "5"
    assert second.headers["x-trace-id"] == "t-42"


async def test_priority_picks_the_lane_each_request_is_queued_on(
    harness: Harness, redis: aioredis.Redis
) -> None:
    base = await harness.http_server([number_stage()])  # no worker: the streams keep them

    def sync_call() -> None:
        with Client(base) as client, pytest.raises(ConveyorHTTPError, match="504"):
            client.call("double", value=1, timeout=0.2, priority="bulk")

    await asyncio.to_thread(sync_call)
    async with AsyncClient(base) as client:
        with pytest.raises(ConveyorHTTPError, match="504"):
            await client.call("double", value=2, timeout=0.2)  # default: interactive
        await client.submit("double", value=3)  # default: bulk
        await client.submit("double", value=4, priority="interactive")
        [late] = await client.map(
            "double",
            [{"value": 5}],
            timeout=0.2,
            priority="bulk",
            progress=False,
            return_exceptions=True,
        )
        assert isinstance(late, ConveyorHTTPError)
        assert late.status == 504
    queued_on = {}
    for lane in ("interactive", "bulk"):
        entries: Any = await redis.xrange(harness.keys.stage_stream("double", lane))
        queued_on[lane] = [decode_request(fields).payload["value"] for _, fields in entries]
    assert queued_on == {"interactive": [2, 4], "bulk": [1, 3, 5]}


async def test_the_api_key_is_sent_as_a_bearer_token(harness: Harness) -> None:
    stage = number_stage(batch_wait_ms=0)
    worker = harness.worker(stage, Doubler())
    await worker.start()
    harness.run(worker)
    base = await harness.http_server([stage], api_keys=["k1"])
    async with AsyncClient(base, api_key="k1") as client:
        assert await client.call("double", value=1) == {"value": 2}
    async with AsyncClient(base) as client:
        with pytest.raises(ConveyorHTTPError) as refused:
            await client.call("double", value=1)
    assert refused.value.status == 401


async def test_errors_raise_at_once_with_status_and_detail(harness: Harness) -> None:
    base, _ = await doubling(harness, batch_wait_ms=0)
    network = Recording()
    async with AsyncClient(base, transport=network) as client:
        with pytest.raises(ConveyorHTTPError) as invalid:
            await client.call("double", value="x")
        with pytest.raises(ConveyorHTTPError) as failed:
            await client.call("double", value=1, fail=True)
        with pytest.raises(ConveyorHTTPError) as unknown:
            await client.call("nope", value=1)
    assert invalid.value.status == 422
    assert isinstance(invalid.value.detail, list)
    assert invalid.value.detail[0]["loc"] == ["body", "value"]
    assert str(invalid.value).startswith("422 from /v1/double: body.value: ")
    assert failed.value.status == 500
    assert "poisoned item" in str(failed.value.detail)
    assert failed.value.request_id
    assert f"(request {failed.value.request_id})" in str(failed.value)
    assert unknown.value.status == 404
    assert network.statuses == [422, 500, 404]  # none retried


async def test_503_is_retried_after_retry_after_then_raised(harness: Harness) -> None:
    stage = number_stage()  # no worker: the queued item keeps the backlog at its bound
    base = await harness.http_server([stage], max_backlog=1, admission_refresh_ms=0)
    await harness.enqueue("double", [{"value": 0}])
    network = Recording()
    started = time.monotonic()
    async with AsyncClient(base, retries=1, transport=network) as client:
        with pytest.raises(ConveyorHTTPError) as refused:
            await client.call("double", value=1)
    assert time.monotonic() - started >= 0.9  # it waited the Retry-After (1 s) once
    assert network.statuses == [503, 503]
    assert refused.value.status == 503
    assert refused.value.retry_after == 1.0
    assert "503 from /v1/double: stage 'double' is at capacity" in str(refused.value)
    assert "bound 1: the stage's max_backlog, or CONVEYOR_MAX_BACKLOG)" in str(refused.value)

    def no_retries() -> ConveyorHTTPError:
        no_wait = Client(base, retries=0, backlog_wait=0)  # submit waits out a 503 by default
        with no_wait as client, pytest.raises(ConveyorHTTPError) as exc:
            client.submit("double", value=1, priority="interactive")  # the full lane
        return exc.value

    assert (await asyncio.to_thread(no_retries)).status == 503


async def test_a_retried_503_succeeds_once_the_backlog_drains(harness: Harness) -> None:
    stage = number_stage(batch_wait_ms=0)
    base = await harness.http_server([stage], max_backlog=1, admission_refresh_ms=0)
    await harness.enqueue("double", [{"value": 0}])
    network = Recording()
    async with AsyncClient(base, transport=network) as client:
        call = asyncio.create_task(client.call("double", value=5))
        await network.refused.wait()
        worker = harness.worker(stage, Doubler())
        await worker.run(burst=True)  # drains the backlog while the client waits to retry
        harness.run(worker)
        assert await call == {"value": 10}
    assert network.statuses[0] == 503
    assert network.statuses[-1] == 200


async def test_a_refused_connection_is_retried_then_raised() -> None:
    network = CountingSync()

    def call() -> None:
        with Client(f"http://127.0.0.1:{free_port()}", retries=2, transport=network) as client:
            client.call("double", value=1)

    started = time.monotonic()
    with pytest.raises(httpx.ConnectError):
        await asyncio.to_thread(call)
    assert network.attempts == 3
    assert time.monotonic() - started >= 0.7  # backed off 0.25 s, then 0.5 s


async def test_submit_and_wait_for_jobs(harness: Harness) -> None:
    stage = number_stage(batch_wait_ms=0)
    base = await harness.http_server([stage])
    async with AsyncClient(base) as client:
        first = await client.submit("double", value=4)
        with Client(base) as sync:
            second = await asyncio.to_thread(sync.submit, "double", {"value": 5})
        record = await client.job(first)
        assert record == {"id": first, "pipeline": "double", "status": "queued"}
        with pytest.raises(TimeoutError):
            await client.wait(first, timeout=0.3, poll_s=0.05)
        await harness.worker(stage, Doubler()).run(burst=True)
        assert await client.wait(first, timeout=10) == {"value": 8}
        with Client(base) as sync:
            assert await asyncio.to_thread(sync.wait, second, timeout=10) == {"value": 10}
        with pytest.raises(ConveyorHTTPError) as unknown:
            await client.job("nope")
    assert unknown.value.status == 404


async def test_a_failed_job_raises_its_status_and_error(harness: Harness) -> None:
    stage = number_stage(batch_wait_ms=0)
    base = await harness.http_server([stage])
    async with AsyncClient(base) as client:
        job_id = await client.submit("double", {"value": 1, "fail": True})
        await harness.worker(stage, Doubler()).run(burst=True)
        with pytest.raises(ConveyorHTTPError) as failed:
            await client.wait(job_id, timeout=10)
    assert failed.value.status == 500
    assert "poisoned item" in str(failed.value.detail)
    assert failed.value.request_id == job_id


async def test_an_expired_job_raises_the_status_its_record_holds(harness: Harness) -> None:
    base = await harness.http_server([number_stage()])  # no worker: the job never runs
    async with AsyncClient(base) as client:
        job_id = await client.submit("double", {"value": 1}, timeout=0.2)
        with pytest.raises(ConveyorHTTPError) as expired:
            await client.wait(job_id, timeout=10, poll_s=0.05)
        record = await client.job(job_id)
    assert expired.value.status == record["http_status"] == 504
    assert str(expired.value.detail) == record["error"]
    assert expired.value.request_id == job_id


async def test_cancel_a_job_on_both_clients(harness: Harness) -> None:
    stage = number_stage(batch_wait_ms=0)
    base = await harness.http_server([stage])  # no worker yet: the jobs stay queued
    async with AsyncClient(base) as client:
        job_id = await client.submit("double", value=1)
        view = await client.cancel(job_id)
        assert view == {
            "id": job_id,
            "pipeline": "double",
            "status": "cancelled",
            "error": "cancelled",
            "http_status": 499,
        }
        assert await client.job(job_id) == view
        with pytest.raises(ConveyorHTTPError) as waited:
            await client.wait(job_id, timeout=10)
        with pytest.raises(ConveyorHTTPError) as again:
            await client.cancel(job_id)
        with pytest.raises(ConveyorHTTPError) as unknown:
            await client.cancel("no-such-job")
        finished = await client.submit("double", value=2)

    assert (waited.value.status, waited.value.request_id) == (499, job_id)
    assert again.value.status == 409
    assert "already finished (cancelled)" in str(again.value.detail)
    assert unknown.value.status == 404
    await harness.worker(stage, Doubler()).run(burst=True)

    def sync() -> tuple[Any, ...]:
        with Client(base) as client:
            job_id = client.submit("double", value=3)
            view = client.cancel(job_id)
            with pytest.raises(ConveyorHTTPError) as waited:
                client.wait(job_id, timeout=10)
            with pytest.raises(ConveyorHTTPError) as done:
                client.cancel(finished)
            return view["status"], waited.value.status, done.value.status, client.job(finished)

    status, waited_status, done_status, record = await asyncio.to_thread(sync)
    assert (status, waited_status, done_status) == ("cancelled", 499, 409)
    assert record["result"] == {"value": 4}  # a finished job stays as it was


async def test_an_abandoned_call_cancels_its_request(
    harness: Harness, redis: aioredis.Redis
) -> None:
    model = Doubler(delay_s=1.0)  # the batch is running when the caller gives up
    base = await serve(harness, number_stage(), model)
    async with AsyncClient(base) as client:
        call = asyncio.create_task(client.call("double", value=1))
        await until(lambda: asyncio.to_thread(model.started.is_set))
        request = await queued(redis, harness, "double")
        assert not await cancelled(redis, harness, request.id)
        call.cancel()  # e.g. an asyncio.timeout around the call ran out
        with pytest.raises(asyncio.CancelledError):
            await call
        # The client closed its connection: the gateway saw it go and cancelled.
        await until(lambda: cancelled(redis, harness, request.id), 10)
        assert await client.call("double", value=2) == {"value": 4}  # the pool still works


async def test_an_abandoned_stream_cancels_its_request(
    harness: Harness, redis: aioredis.Redis
) -> None:
    model = Held()
    base = await serve(harness, held_stage(), model)

    async def marked(nth: int) -> bool:
        return await cancelled(redis, harness, (await queued(redis, harness, "held", nth)).id)

    def sync_abandon() -> str:
        with Client(base) as client:
            tokens = client.stream("held", text="hi")
            first = next(tokens)
            tokens.close()  # or dropped: a generator is closed when it is collected
            return first

    try:
        assert await asyncio.to_thread(sync_abandon) == "one"
        await until(lambda: marked(0), 10)
        model.release()  # the abandoned batch finishes
        async with AsyncClient(base) as client:
            async for token in client.stream("held", text="hi"):
                assert token == "one"
                break  # the loop finalizes the abandoned generator, which closes the stream
            await until(lambda: marked(1), 10)
    finally:
        model.release(10)


async def test_stream_tokens_add_up_to_the_final_result(harness: Harness) -> None:
    stage = BUILTIN["generate"]
    worker = harness.worker(stage, device="cpu", batch_wait_ms=0)
    await worker.start()
    harness.run(worker)
    base = await harness.http_server([stage])
    body: dict[str, Any] = {"text": "once upon a time", "max_new_tokens": 8}
    async with AsyncClient(base) as client:
        events = [event async for event in client.stream_events("generate", body)]
        tokens = [token async for token in client.stream("generate", **body)]
        with pytest.raises(ConveyorHTTPError) as refused:
            [token async for token in client.stream("generate", text="")]
    *partials, (last, result) = events
    assert last == "done"
    assert partials
    assert all(kind == "token" for kind, _ in partials)
    assert "".join(data["text"] for _, data in partials) == result["generated_text"]
    assert "".join(tokens) == result["generated_text"]  # greedy decoding: the same text
    assert refused.value.status == 422

    def sync_stream() -> tuple[list[str], list[tuple[str, dict[str, Any]]]]:
        with Client(base) as sync:
            return list(sync.stream("generate", body)), list(sync.stream_events("generate", body))

    sync_tokens, sync_events = await asyncio.to_thread(sync_stream)
    assert "".join(sync_tokens) == result["generated_text"]
    assert sync_events == events


async def test_an_error_event_raises(harness: Harness) -> None:
    stage = Stage("broken", GenerateIn, runner="unused", streaming=True)
    worker = harness.worker(stage, Broken())
    await worker.start()
    harness.run(worker)
    base = await harness.http_server([stage])
    seen: list[str] = []

    async def read(tokens: AsyncIterator[str]) -> None:
        async for token in tokens:
            seen.append(token)

    async with AsyncClient(base) as client:
        with pytest.raises(ConveyorHTTPError) as failed:
            await read(client.stream("broken", text="hi"))
    assert seen == ["once"]
    assert failed.value.status == 500
    assert "out of words" in str(failed.value.detail)
    assert failed.value.path == "/v1/broken/stream"


async def test_map_keeps_input_order_with_bounded_concurrency(
    harness: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    base, model = await doubling(harness, batch_wait_ms=20)
    inputs = [{"value": i} for i in range(50)]
    expected = [{"value": 2 * i} for i in range(50)]
    with Client(base) as sync:
        mapped = await asyncio.to_thread(sync.map, "double", inputs, concurrency=8, progress=False)
    assert mapped == expected
    async with AsyncClient(base) as client:
        assert await client.map("double", inputs, concurrency=8) == expected
    assert "50/50" in capsys.readouterr().err  # the progress bar
    sizes = [len(batch) for batch in model.batches]
    assert sum(sizes) == 100
    assert 1 < max(sizes) <= 8  # requests overlapped, never more than 8 at once


async def test_map_puts_errors_in_place_or_raises(harness: Harness) -> None:
    base, _ = await doubling(harness, batch_wait_ms=0)
    inputs: list[dict[str, Any]] = [{"value": i, "fail": i % 3 == 0} for i in range(9)]
    inputs[4] = {"value": "four"}
    expected = [500, {"value": 2}, {"value": 4}, 500, 422, {"value": 10}, 500, {"value": 14}]
    expected.append({"value": 16})

    def outcomes(results: list[dict[str, Any] | Exception]) -> list[Any]:
        return [r.status if isinstance(r, ConveyorHTTPError) else r for r in results]

    async with AsyncClient(base) as client:
        mapped = await client.map("double", inputs, progress=False, return_exceptions=True)
        assert outcomes(mapped) == expected
        with pytest.raises(ConveyorHTTPError):
            await client.map("double", inputs, progress=False)
    with Client(base) as sync:
        mapped = await asyncio.to_thread(
            sync.map, "double", inputs, progress=False, return_exceptions=True
        )
        assert outcomes(mapped) == expected
        with pytest.raises(ConveyorHTTPError):
            await asyncio.to_thread(sync.map, "double", inputs, progress=False)


class Stalling(Doubler):
    """Doubles ``value``, but holds a batch holding one of ``stalls`` until it is released."""

    def __init__(self, *stalls: int) -> None:
        super().__init__()
        self.gates = {value: threading.Event() for value in stalls}

    def predict(self, items: list[Item]) -> list[Result]:
        for item in items:
            if gate := self.gates.get(item["value"]):
                gate.wait(60)
        return super().predict(items)

    def release(self) -> None:
        for gate in self.gates.values():
            gate.set()


async def test_map_keeps_every_result_when_one_input_times_out(harness: Harness) -> None:
    # Two workers, a batch of one at a time each: the stalled input holds one of them and
    # the other answers the rest, so exactly one call gets no answer in time.
    stage, model = number_stage(batch_wait_ms=0, max_batch_size=1), Stalling(5, 105)
    for _ in range(2):
        worker = harness.worker(stage, model, max_concurrent_batches=1)
        await worker.start()
        harness.run(worker)
    base = await harness.http_server([stage])
    try:
        inputs = [{"value": i} for i in range(20)]
        async with AsyncClient(base, timeout=3) as client:
            mapped = await client.map(
                "double", inputs, concurrency=4, progress=False, return_exceptions=True
            )
        model.gates[5].set()  # its worker is free again for the second map
        assert isinstance(mapped.pop(5), httpx.ReadTimeout)
        assert mapped == [{"value": 2 * i} for i in range(20) if i != 5]

        inputs = [{"value": 100 + i} for i in range(20)]
        with Client(base, timeout=3) as sync:
            mapped = await asyncio.to_thread(
                sync.map, "double", inputs, concurrency=4, progress=False, return_exceptions=True
            )
        assert isinstance(mapped.pop(5), httpx.ReadTimeout)
        assert mapped == [{"value": 2 * (100 + i)} for i in range(20) if i != 5]
    finally:
        model.release()


def sent_values(requests: list[httpx.Request]) -> list[int]:
    """The ``value`` of each request's JSON body, sorted."""
    return sorted(json.loads(request.content)["value"] for request in requests)


async def test_map_raises_the_first_error_and_a_second_map_sends_only_what_is_missing(
    harness: Harness,
) -> None:
    base, model = await doubling(harness, batch_wait_ms=0)
    inputs: list[dict[str, Any]] = [{"value": i} for i in range(60)]
    expected = [{"value": 2 * i} for i in range(60)]
    network = Recording()
    async with AsyncClient(base, transport=network) as client:
        done: dict[int, dict[str, Any]] = {}
        failing = [*inputs[:2], {"value": 2, "fail": True}, *inputs[3:]]
        with pytest.raises(ConveyorHTTPError) as failed:
            await client.map("double", failing, concurrency=4, progress=False, done=done)
        assert failed.value.status == 500
        first = len(network.requests)
        # The error cancelled the rest: most inputs were never sent.
        assert first < len(inputs) / 2
        assert 2 not in done
        assert all(done[i] == expected[i] for i in done)
        missing = sorted(set(range(60)) - set(done))
        assert await client.map("double", inputs, progress=False, done=done) == expected
    assert sent_values(network.requests[first:]) == missing  # each missing input, once
    assert sorted(done) == list(range(60))

    # The sync client, on a stage of its own (none of the async map's cancelled requests
    # can reach its model).
    base, model = await doubling(harness, name="twice", batch_wait_ms=0)
    counting = CountingSync()
    with Client(base, transport=counting) as sync:
        done = {}
        with pytest.raises(ConveyorHTTPError) as failed:
            await asyncio.to_thread(
                sync.map, "twice", failing, concurrency=4, progress=False, done=done
            )
        assert failed.value.status == 500
        first = len(counting.requests)
        assert first < len(inputs) / 2  # none started after the error
        missing = sorted(set(range(60)) - set(done))
        mapped = await asyncio.to_thread(sync.map, "twice", inputs, progress=False, done=done)
    assert mapped == expected
    assert sent_values(counting.requests[first:]) == missing
    # Each input sent once across both maps, the failed one twice: the calls in flight at
    # the error (a thread is not stopped mid-call) finished into ``done``.
    assert len(counting.requests) == len(inputs) + 1
    assert {value for batch in model.batches for value in batch} == set(range(60))


async def test_submit_waits_for_room_in_a_full_jobs_backlog(harness: Harness) -> None:
    stage = number_stage(batch_wait_ms=0)
    base = await harness.http_server([stage], max_backlog=2, admission_refresh_ms=0)
    network = Recording()
    async with AsyncClient(base, retries=0, backlog_wait=120, transport=network) as client:
        queued = [await client.submit("double", value=i) for i in range(2)]  # the cap
        submit = asyncio.create_task(client.submit("double", value=2))
        await network.refused.wait()  # the bulk lane is full: 503, and the client waits
        worker = harness.worker(stage, Doubler())
        await worker.start()
        harness.run(worker)
        job_id = await submit
        assert await client.wait(job_id, timeout=30) == {"value": 4}
        assert [await client.wait(j, timeout=30) for j in queued] == [{"value": 0}, {"value": 2}]
    assert network.statuses[:3] == [202, 202, 503]
    assert network.statuses.count(202) == 3


Scripted = tuple[int, Any, dict[str, str]] | type[httpx.TransportError]


def scripted(flow: Flow[Any], *answers: Scripted) -> tuple[Any, list[str], list[float]]:
    """Drive ``flow`` as a client would, answering its requests with ``answers`` in turn
    (``(status, json, headers)``, or a transport error to raise): its result (or the error it
    raised), the requests it sent and the waits it asked for."""
    script, sent, slept = list(answers), list[str](), list[float]()
    answer: httpx.Response | httpx.TransportError | None = None
    try:
        while True:
            effect = flow.send(answer)
            if isinstance(effect, Sleep):
                slept.append(effect.seconds)
                answer = None
                continue
            sent.append(f"{effect.request.method} {effect.request.url.path}")
            step = script.pop(0)
            if isinstance(step, tuple):
                status, body, headers = step
                answer = httpx.Response(status, json=body, headers=headers, request=effect.request)
            else:
                answer = step("scripted", request=effect.request)
    except StopIteration as done:
        outcome = done.value
    except (ConveyorHTTPError, httpx.TransportError, TimeoutError) as exc:
        outcome = exc
    assert not script, "answers left over"
    return outcome, sent, slept


def test_a_flow_backs_off_and_honours_retry_after_until_an_answer() -> None:
    with Client("http://gateway.test", retries=3) as client:
        result, sent, slept = scripted(
            client._call(Post("double", {"value": 1})),
            httpx.ConnectError,
            (503, {"detail": "busy"}, {"Retry-After": "2"}),
            (503, {"detail": "busy"}, {}),
            (200, {"value": 2}, {}),
        )
    assert result == {"value": 2}
    assert sent == ["POST /v1/double"] * 4
    assert slept == [0.25, 2.0, 1.0]  # backoff 0.25 s; Retry-After; backoff 0.25 s * 2**2


def test_a_flow_gives_up_or_never_retries_what_may_have_run() -> None:
    busy = (503, {"detail": "busy"}, {"Retry-After": "60"})
    still_busy = (503, {"detail": "still busy", "request_id": "r1"}, {"Retry-After": "60"})
    record = {"id": "j1", "pipeline": "double", "status": "queued"}
    with Client("http://gateway.test", retries=1, backlog_wait=0) as client:
        refused, _, slept = scripted(client._submit(Post("double", value=1)), busy, still_busy)
        assert slept == [5.0]  # Retry-After, capped at MAX_RETRY_WAIT_S
        assert isinstance(refused, ConveyorHTTPError)
        assert (refused.status, refused.detail, refused.request_id) == (503, "still busy", "r1")
        assert refused.retry_after == 60.0
        for status in (500, 504):
            answer: Scripted = (status, {"detail": "failed"}, {})
            failed, sent, slept = scripted(client._call(Post("double", value=1)), answer)
            assert isinstance(failed, ConveyorHTTPError)
            assert (failed.status, len(sent), slept) == (status, 1, [])
        # A read that timed out may have run the model: a POST is not sent again, a GET is.
        cut, sent, slept = scripted(client._call(Post("double", value=1)), httpx.ReadTimeout)
        assert (isinstance(cut, httpx.ReadTimeout), len(sent), slept) == (True, 1, [])
        read, sent, slept = scripted(client._job("j1"), httpx.ReadTimeout, (200, record, {}))
        assert (read, sent, slept) == (record, ["GET /v1/jobs/j1"] * 2, [0.25])


def test_the_wait_flow_polls_until_the_job_finishes() -> None:
    queued = {"id": "j1", "pipeline": "double", "status": "queued"}
    done = {**queued, "status": "done", "result": {"value": 2}}
    failed = {**queued, "status": "failed", "error": "poisoned item", "http_status": 500}
    with Client("http://gateway.test") as client:
        result, sent, slept = scripted(
            client._wait("j1", 60, 0.5), (200, queued, {}), (200, queued, {}), (200, done, {})
        )
        assert (result, sent) == ({"value": 2}, ["GET /v1/jobs/j1"] * 3)
        assert slept == [0.5, 0.5]
        error, _, _ = scripted(client._wait("j1", 60, 0.5), (200, failed, {}))
        late, _, slept = scripted(client._wait("j1", 0, 0.5), (200, queued, {}))
    assert isinstance(error, ConveyorHTTPError)
    assert (error.status, error.detail, error.path) == (500, "poisoned item", "/v1/jobs/j1")
    assert isinstance(late, TimeoutError)
    assert slept == []


def test_a_finished_job_without_its_http_status_still_raises_its_error() -> None:
    # What a gateway always sends, a proxy might drop: the client still raises a
    # ConveyorHTTPError (504 for an expired job, else 500), never a KeyError.
    expired = {"id": "j1", "pipeline": "double", "status": "expired", "error": "too late"}
    failed = {**expired, "status": "failed", "error": "poisoned item"}
    with Client("http://gateway.test") as client:
        late, _, _ = scripted(client._wait("j1", 60, 0.5), (200, expired, {}))
        bad, _, _ = scripted(client._wait("j1", 60, 0.5), (200, failed, {}))
    assert isinstance(late, ConveyorHTTPError)
    assert isinstance(bad, ConveyorHTTPError)
    assert (late.status, bad.status) == (504, 500)


def test_the_cancel_flow_deletes_once_and_raises_a_conflict() -> None:
    cancelled = {"id": "j1", "pipeline": "double", "status": "cancelled", "error": "cancelled"}
    finished = {"detail": "job 'j1' has already finished (done)", "request_id": "j1"}
    with Client("http://gateway.test") as client:
        view, sent, _ = scripted(client._cancel("j1"), (200, cancelled, {}))
        conflict, _, slept = scripted(client._cancel("j1"), (409, finished, {}))
        # A lost answer is not sent again: the first may have cancelled it (then: 409).
        lost, sent_lost, _ = scripted(client._cancel("j1"), httpx.ReadTimeout)
        waited, _, _ = scripted(client._wait("j1", 60, 0.5), (200, cancelled, {}))
    assert (view, sent) == (cancelled, ["DELETE /v1/jobs/j1"])
    assert isinstance(conflict, ConveyorHTTPError)
    assert (conflict.status, conflict.detail, slept) == (409, finished["detail"], [])
    assert (isinstance(lost, httpx.ReadTimeout), len(sent_lost)) == (True, 1)
    assert isinstance(waited, ConveyorHTTPError)
    assert (waited.status, waited.detail) == (499, "cancelled")  # no http_status: 499


def test_the_map_flow_keeps_each_result_as_it_comes() -> None:
    done: dict[int, dict[str, Any]] = {0: {"value": 0}}
    with Client("http://gateway.test") as client:
        result, sent, _ = scripted(
            client._mapped(Map("double", []), 3, {"value": 2}, done), (200, {"value": 4}, {})
        )
        refused, _, _ = scripted(
            client._mapped(Map("double", []), 4, {"value": "x"}, done),
            (422, {"detail": "bad"}, {}),
        )
    assert (result, sent) == ({"value": 4}, ["POST /v1/double"])
    assert isinstance(refused, ConveyorHTTPError)
    assert done == {0: {"value": 0}, 3: {"value": 4}}  # a failure is never "done"
    items, kept, todo = Map("double", [{"value": i} for i in range(5)], done=done).plan()
    assert (len(items), kept is done, todo) == (5, True, [1, 2, 4])
    with pytest.raises(ValueError, match="not indexes of the 2 inputs"):
        Map("double", [{}, {}], done=done).plan()  # kept for other (more) inputs


def test_submit_retries_a_503_for_its_backlog_wait() -> None:
    busy: Scripted = (503, {"detail": "at capacity"}, {"Retry-After": "2"})
    made: Scripted = (202, {"id": "j1"}, {})
    with Client("http://gateway.test", retries=1, backlog_wait=3600) as client:
        job_id, sent, slept = scripted(client._submit(Post("double", value=1)), *[busy] * 6, made)
        assert (job_id, len(sent), slept) == ("j1", 7, [2.0] * 6)  # past ``retries``
        # A call is not patient: its 503 means "shed load now", so retries bound it.
        refused, sent, _ = scripted(client._call(Post("double", value=1)), busy, busy)
        assert (isinstance(refused, ConveyorHTTPError), len(sent)) == (True, 2)
    with Client("http://gateway.test", retries=1, backlog_wait=0) as client:
        refused, sent, _ = scripted(client._submit(Post("double", value=1)), busy, busy)
        assert (isinstance(refused, ConveyorHTTPError), len(sent)) == (True, 2)


def test_both_clients_take_the_same_parameters() -> None:
    request = (
        "(self, name: 'str', payload: 'Payload | None' = None, /, *, "
        "timeout: 'float | None' = None, trace_id: 'str | None' = None, "
        "priority: 'Lane | None' = None, **fields: 'Any')"
    )
    bulk = (
        "(self, name: 'str', inputs: 'Iterable[Payload]', *, concurrency: 'int' = 16, "
        "progress: 'bool' = True, return_exceptions: 'bool' = False, "
        "timeout: 'float | None' = None, priority: 'Lane | None' = None, "
        "done: 'MutableMapping[int, Json] | None' = None)"
    )
    for kind in (Client, AsyncClient):
        for method in ("call", "submit", "stream", "stream_events"):
            assert str(inspect.signature(getattr(kind, method))).startswith(request + " -> ")
        assert str(inspect.signature(kind.map)).startswith(bulk + " -> ")
    for method in ("call", "submit", "job", "wait", "cancel", "map"):
        assert inspect.iscoroutinefunction(getattr(AsyncClient, method))
    assert AsyncClient.call.__doc__ == "[`Client.call`][]."
    with Client("http://gateway.test") as client:  # bound: without ``self``
        assert str(inspect.signature(client.call)).startswith("(name: 'str', payload")
