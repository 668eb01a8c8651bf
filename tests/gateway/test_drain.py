"""A draining gateway (:meth:`Gateway.drain <gateway.service.Gateway.drain>`, what
``python -m gateway`` does on SIGTERM): new requests get 503, those waiting are answered
504 in JSON when the drain ends, a stream with an ``error`` event; then it has settled.
The whole stop, with real processes and workers that answer, is
``tests/conveyor/test_supervisor.py``'s."""

from __future__ import annotations

import asyncio

import httpx

from gateway.app import create_app
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from pipelines.graph import single
from pipelines.registry import Registry
from tests.helpers import Harness, number_stage, until


async def test_a_draining_gateway_refuses_new_requests_and_answers_those_waiting(
    harness: Harness,
) -> None:
    # No worker reads the stage: whatever is admitted waits until the drain ends.
    stage = number_stage(streaming=True)
    app = create_app(GatewaySettings(reply_block_ms=100), Registry([single(stage)]))
    gw: Gateway = app.state.gateway
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http,
    ):
        call = asyncio.create_task(http.post("/v1/double", json={"value": 1}))
        events = asyncio.create_task(http.post("/v1/double/stream", json={"value": 2}))

        async def both_wait() -> bool:
            return gw.replies.waiting == 2

        await until(both_wait, limit_s=10)
        drained = asyncio.create_task(gw.drain(0.5))

        async def draining() -> bool:
            return gw.draining

        await until(draining, limit_s=10)
        refused = await http.post("/v1/double", json={"value": 3})
        assert refused.status_code == 503
        assert refused.json() == {"detail": "this gateway is stopping; retry"}
        assert refused.headers["retry-after"] == "1"
        assert (await http.get("/readyz")).status_code == 503
        assert not drained.done()  # the two still wait

        answer = await call
        assert answer.status_code == 504
        assert answer.headers["content-type"] == "application/json"
        assert answer.json()["detail"] == "the gateway stopped: no result within its 0.5s drain"
        stream = await events
        assert stream.status_code == 200  # its events had begun: the last one says it
        assert stream.text.endswith(
            'event: error\ndata: {"detail":"the gateway stopped: no result within its 0.5s '
            'drain","status":504}\n\n'
        )
        await asyncio.wait_for(drained, 5)  # settled: nothing waits any more
