"""One request of many inputs never takes every other client's share of a stage's backlog:
a real gateway (uvicorn on loopback), a real worker and a real Redis."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.share import in_parts
from pipelines.errors import DeadlineExceeded
from pipelines.model import Item, Result
from pipelines.stages import Stage, TextIn
from runtime.status import stage_status
from runtime.waiting import cancel_and_wait
from tests.helpers import Harness, until

BOUND = 40
"""The stage's backlog bound: the big request holds at most half of it (the default share)."""
INPUTS = 120
"""The big request's texts: three times the bound (the documented maximum is 2048, for a
bound of 1024: the same proportions, at a size a test runs in seconds)."""
BIG = ["big0", "big1"]
SMALL = [f"small{i}" for i in range(8)]
"""One API key per client."""


class GatedEmbedder:
    """Embeds the text ``"<i>"`` as ``[i]``; its first call waits until :attr:`gate` is set,
    so the stage's backlog is held as the big request left it while the others ask."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()

    def predict(self, items: list[Item]) -> list[Result]:
        """One vector per text, after the gate opened (a minute at most: a broken test
        ends, the model does not hang its worker)."""
        self.started.set()
        self.gate.wait(60)
        time.sleep(0.02)  # the model's own cost, in its thread
        return [{"embedding": [float(i["text"])]} for i in items]


def _stage() -> Stage:
    return Stage(
        "toyembed",
        TextIn,
        runner="tests.gateway.test_fair_backlog:GatedEmbedder",
        openai="embeddings",
        max_backlog=BOUND,
        max_batch_size=4,
    )


def _embed(base: str, key: str, texts: list[str]) -> Any:
    headers = {"Authorization": f"Bearer {key}", "X-Conveyor-Timeout": "60"}
    body = {"model": "toyembed", "input": texts, "encoding_format": "float"}

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(base_url=base, timeout=90) as client:  # its own connection
            return await client.post("/v1/embeddings", json=body, headers=headers)

    return asyncio.create_task(post())


async def _serve(harness: Harness) -> tuple[Stage, GatedEmbedder, str]:
    stage = _stage()
    model = GatedEmbedder()
    worker = harness.worker(stage, model)
    await worker.start()
    harness.run(worker)
    return stage, model, await harness.http_server([stage], api_keys=",".join(BIG + SMALL))


@pytest.mark.parametrize("bigs", [1, 2])
async def test_big_requests_leave_room_for_every_other_client(
    harness: Harness, redis: aioredis.Redis, bigs: int
) -> None:
    stage, model, base = await _serve(harness)

    big = [_embed(base, key, [str(i) for i in range(INPUTS)]) for key in BIG[:bigs]]

    async def window_full() -> bool:  # what the big requests hold, their first batch held
        backlog = (await stage_status(redis, harness.keys, stage.name)).backlog
        return model.started.is_set() and backlog >= BOUND // 2

    await until(window_full, 30)
    smalls = [_embed(base, key, [str(1000 + n)]) for n, key in enumerate(SMALL)]

    async def each_small_answered_or_queued() -> bool:
        backlog = (await stage_status(redis, harness.keys, stage.name)).backlog
        return all(s.done() for s in smalls) or backlog >= BOUND // 2 + len(smalls)

    await until(each_small_answered_or_queued, 30)
    model.gate.set()

    answers = await asyncio.gather(*smalls)
    assert [a.status_code for a in answers] == [200] * len(smalls), [a.text for a in answers]
    for n, answer in enumerate(answers):
        assert answer.json()["data"][0]["embedding"] == [float(1000 + n)]
    for whole in await asyncio.gather(*big):
        assert whole.status_code == 200, whole.text
        data = whole.json()["data"]
        assert [d["index"] for d in data] == list(range(INPUTS))
        assert [d["embedding"] for d in data] == [[float(i)] for i in range(INPUTS)]


async def test_a_big_request_waits_for_room_instead_of_failing(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Others hold more than half the bound: the big request gets the rest, and each part
    # refused meanwhile waits for one of its own to end instead of failing the request.
    stage, model, base = await _serve(harness)
    others = BOUND * 5 // 8
    await harness.enqueue(stage.name, [{"text": str(2000 + n)} for n in range(others)])
    await until(lambda: asyncio.to_thread(model.started.wait, 0.05), 30)

    big = _embed(base, BIG[0], [str(i) for i in range(INPUTS)])

    async def in_the_stage() -> bool:  # its first parts admitted (the others' still held)
        return big.done() or (await stage_status(redis, harness.keys, stage.name)).backlog > others

    await until(in_the_stage, 30)
    model.gate.set()
    whole = await big
    assert whole.status_code == 200, whole.text
    assert [d["embedding"] for d in whole.json()["data"]] == [[float(i)] for i in range(INPUTS)]


async def _free(slots: asyncio.Semaphore, window: int) -> bool:
    """Whether all ``window`` slots are free (taken here and given back)."""
    for _ in range(window):
        if slots.locked():
            return False
        await slots.acquire()
    for _ in range(window):
        slots.release()
    return True


async def test_parts_hold_at_most_the_window_and_stop_at_a_failure() -> None:
    slots = asyncio.Semaphore(3)
    started: list[int] = []
    running: set[int] = set()
    peak = 0

    async def run(i: int, left_s: float) -> int:
        nonlocal peak
        assert 0 < left_s <= 30
        started.append(i)
        running.add(i)
        peak = max(peak, len(running))
        await asyncio.sleep(0)
        running.discard(i)
        return 2 * i

    assert await in_parts(run, 5, slots, 30) == [0, 2, 4, 6, 8]
    assert (peak, sorted(started)) == (3, [0, 1, 2, 3, 4])

    failed = asyncio.Event()

    async def fails(i: int, left_s: float) -> int:
        started.append(i)
        if i == 2:
            failed.set()
            raise ValueError("item 2")
        await failed.wait()  # the others end after it failed
        return i

    started.clear()
    with pytest.raises(ValueError, match="item 2"):
        await in_parts(fails, 40, slots, 30)
    assert sorted(started) == [0, 1, 2]  # none started once it failed
    assert await _free(slots, 3)


async def test_a_request_cancelled_midway_gives_its_slots_back() -> None:
    slots = asyncio.Semaphore(3)
    forever = asyncio.Event()

    async def run(i: int, left_s: float) -> int:
        await forever.wait()
        return i

    first = asyncio.create_task(in_parts(run, 10, slots, 30))
    second = asyncio.create_task(in_parts(run, 10, slots, 30))  # in line for a slot
    await until(lambda: asyncio.sleep(0, slots.locked()), 5)
    await cancel_and_wait([first, second])
    assert await _free(slots, 3)


async def test_the_parts_share_the_requests_one_deadline() -> None:
    slots = asyncio.Semaphore(1)
    lefts: list[float] = []

    async def run(i: int, left_s: float) -> int:
        lefts.append(left_s)
        await asyncio.sleep(0.15)  # at least: past the whole request's budget
        return i

    with pytest.raises(DeadlineExceeded, match=r"within 0\.1s"):
        await in_parts(run, 3, slots, 0.1)  # the second's turn comes past the budget
    assert len(lefts) == 1
    assert 0 < lefts[0] <= 0.1
    assert await _free(slots, 1)


async def test_a_big_request_out_of_time_names_its_whole_budget(harness: Harness) -> None:
    # Its parts each get what is left of the request's time; the one that runs out said
    # "no result within 0.151s" (its own remainder). The answer names the request's budget.
    _, model, base = await _serve(harness)
    headers = {"Authorization": f"Bearer {BIG[0]}", "X-Conveyor-Timeout": "1"}
    body = {"model": "toyembed", "input": [str(i) for i in range(INPUTS)]}
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            resp = await client.post("/v1/embeddings", json=body, headers=headers)
    finally:
        model.gate.set()
    assert resp.status_code == 504, resp.text
    message = resp.json()["error"]["message"]
    assert f"no result for all {INPUTS} inputs within 1s" in message, message
