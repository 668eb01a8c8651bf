"""A function step's items are calls of their own: one slow item holds only itself. The
stage keeps reading and answering while it waits; it alone ends, at its own deadline or
when cancelled. Real Redis, real worker and gateway (HTTP through the app)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from pipelines.graph import Pipeline, function
from pipelines.registry import Registry
from tests.helpers import Harness, until

SLOW_S = 10.0
"""The slow request's deadline: far past what the others take, even on a loaded machine.
Nothing waits it out but the checks that the slow one ends there."""

OTHERS = 20


class Kind(BaseModel):
    """What a request asks the step to do: ``slow`` holds its call; ``ok`` answers."""

    kind: str
    n: int = 0


class Probe:
    """What the slow call did, seen from the test (it runs in the runner's thread)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()  # its await was cancelled
        self.release = threading.Event()  # lets a sync slow call return
        self.returned = threading.Event()

    async def step(self, item: dict[str, Any]) -> dict[str, Any]:
        """Answers at once, but for ``slow``: awaits until cancelled."""
        if item["kind"] == "slow":
            self.started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return {"kind": item["kind"], "n": item["n"]}

    def sync_step(self, item: dict[str, Any]) -> dict[str, Any]:
        """Answers at once, but for ``slow``: holds its pool thread until released."""
        if item["kind"] == "slow":
            self.started.set()
            self.release.wait(120)  # bounded: released by the test, at its end at the latest
            self.returned.set()
        return {"kind": item["kind"], "n": item["n"]}

    async def running(self) -> bool:
        return self.started.is_set()


async def call(
    http: httpx.AsyncClient, kind: str, n: int = 0, timeout_s: float = 60
) -> httpx.Response:
    headers = {"X-Conveyor-Timeout": f"{timeout_s:g}"}
    return await http.post("/v1/fn", json={"kind": kind, "n": n}, headers=headers, timeout=120)


async def serve(harness: Harness, step: Any) -> httpx.AsyncClient:
    """A worker of the one-step pipeline ``fn`` running ``step``, and a gateway."""
    return await harness.serve(Registry([Pipeline("fn", Kind, (function("run", step),))]))


async def others_answered(http: httpx.AsyncClient) -> None:
    """Send :data:`OTHERS` requests at once; each is answered 200 with its own output."""
    answers = await asyncio.gather(*(call(http, "ok", n) for n in range(OTHERS)))
    for n, resp in enumerate(answers):
        assert (resp.status_code, resp.json()) == (200, {"kind": "ok", "n": n}), resp.text


async def counted(harness: Harness, outcome: str, expected: int) -> None:
    """Wait until the stage counts ``expected`` items with ``outcome`` (its worker's)."""

    async def there() -> bool:
        return (await harness.stats("fn.run")).get(f"items:{outcome}", 0) == expected

    await until(there, 30)


async def test_a_slow_async_item_holds_only_itself_and_expires_at_its_deadline(
    harness: Harness,
) -> None:
    # Before: the batch ran whole in the model thread (run_until_complete), so every
    # request behind the slow one waited for its deadline: the slow one was cancelled,
    # and only then did the others run.
    probe = Probe()
    http = await serve(harness, probe.step)
    sent = time.monotonic()
    slow = asyncio.create_task(call(http, "slow", timeout_s=SLOW_S))
    await until(probe.running, 30)
    await others_answered(http)
    # All answered while the slow call still awaits: it never held them.
    assert not probe.cancelled.is_set()
    assert not slow.done()
    resp = await slow
    assert resp.status_code == 504, resp.text
    assert time.monotonic() - sent >= SLOW_S - 0.5  # at its own deadline, not before
    await counted(harness, "expired", 1)  # ended by the worker: its call cancelled there
    assert probe.cancelled.is_set()
    await counted(harness, "ok", OTHERS)


async def test_a_cancelled_slow_item_ends_cancelled_while_others_flow(
    harness: Harness,
) -> None:
    # Before: nothing looked at a running call's cancellation; it awaited on to its
    # deadline (a minute here), holding every request behind it.
    probe = Probe()
    http = await serve(harness, probe.step)
    submitted = await http.post(
        "/v1/jobs/fn", json={"kind": "slow"}, headers={"X-Conveyor-Timeout": "60"}
    )
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    await until(probe.running, 30)
    deleted = await http.delete(f"/v1/jobs/{job_id}")
    assert deleted.status_code == 200, deleted.text
    others = asyncio.create_task(others_answered(http))

    async def call_cancelled() -> bool:
        return probe.cancelled.is_set()

    # Promptly: at the next check of its cancellation (each second), far before its
    # deadline.
    await until(call_cancelled, 20)
    await counted(harness, "cancelled", 1)
    await others
    await counted(harness, "ok", OTHERS)
    job = (await http.get(f"/v1/jobs/{job_id}")).json()
    assert job["status"] == "cancelled", job
    # The stage serves on.
    resp = await call(http, "ok", 99)
    assert (resp.status_code, resp.json()) == (200, {"kind": "ok", "n": 99})


async def test_a_slow_sync_item_holds_one_pool_thread_not_the_stage(harness: Harness) -> None:
    # Before: the batch waited for every call in the model thread, so the others waited
    # for the slow one to return (here: past their own deadlines, answered 504).
    probe = Probe()
    http = await serve(harness, probe.sync_step)
    try:
        slow = asyncio.create_task(call(http, "slow", timeout_s=SLOW_S))
        await until(probe.running, 30)
        await others_answered(http)
        assert not slow.done()
        resp = await slow
        assert resp.status_code == 504, resp.text
        # Answered at its deadline by the worker, its thread still held (a thread cannot
        # be stopped): its result, when it comes, is dropped.
        await counted(harness, "expired", 1)
        assert not probe.returned.is_set()
    finally:
        probe.release.set()

    async def returned() -> bool:
        return probe.returned.is_set()

    await until(returned, 30)
    resp = await call(http, "ok", 99)
    assert (resp.status_code, resp.json()) == (200, {"kind": "ok", "n": 99})
    stats = await harness.stats("fn.run")
    assert (stats.get("items:ok"), stats.get("items:expired")) == (OTHERS + 1, 1), stats


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_function_step_runs_at_most_its_concurrency_at_once(
    harness: Harness, kind: str
) -> None:
    # The items run apart, but no more at once than the step's concurrency: the rest
    # wait for a call to end (read later, not dropped).
    running, most = 0, 0
    lock = threading.Lock()
    gate = threading.Event()

    def enter() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)

    def leave() -> None:
        nonlocal running
        with lock:
            running -= 1

    async def astep(item: dict[str, Any]) -> dict[str, Any]:
        enter()
        try:
            await asyncio.to_thread(gate.wait, 60)
        finally:
            leave()
        return {"kind": item["kind"], "n": item["n"]}

    def sstep(item: dict[str, Any]) -> dict[str, Any]:
        enter()
        try:
            gate.wait(60)
        finally:
            leave()
        return {"kind": item["kind"], "n": item["n"]}

    step = function("run", astep if kind == "async" else sstep, concurrency=3)
    http = await harness.serve(Registry([Pipeline("fn", Kind, (step,))]))
    calls = asyncio.gather(*(call(http, "ok", n) for n in range(8)))

    async def full() -> bool:
        return most == 3

    try:
        await until(full, 30)
    finally:
        gate.set()
    answers = await calls
    assert [r.json()["n"] for r in answers] == list(range(8))
    assert most == 3


async def test_slow_jobs_leave_a_function_step_room_for_interactive_calls(
    harness: Harness,
) -> None:
    # BREAK (round four, re-run): slow async *jobs* (the bulk lane; a job's deadline is an
    # hour) filled every call of a function step, and interactive calls got 504 behind
    # them for as long as the jobs ran. Now jobs hold at most three quarters of the calls.
    gate = threading.Event()
    started = 0

    async def step(item: dict[str, Any]) -> dict[str, Any]:
        nonlocal started
        if item["kind"] == "slow":
            started += 1
            await asyncio.to_thread(gate.wait, 60)
        return {"kind": item["kind"], "n": item["n"]}

    http = await harness.serve(
        Registry([Pipeline("fn", Kind, (function("run", step, concurrency=4),))])
    )
    try:
        for n in range(6):
            resp = await http.post("/v1/jobs/fn", json={"kind": "slow", "n": n})
            assert resp.status_code in (200, 202), resp.text

        async def jobs_running() -> bool:
            return started == 3  # the bulk cap: 4 calls, one kept for interactive work

        await until(jobs_running, 30)
        answer = await call(http, "ok", 99, timeout_s=20)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"kind": "ok", "n": 99}
        assert started == 3  # the jobs beyond the cap still wait their turn
    finally:
        gate.set()

    async def all_jobs_ran() -> bool:
        return started == 6

    await until(all_jobs_ran, 30)
