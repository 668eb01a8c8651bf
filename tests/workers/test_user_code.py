"""User code that raises what is no ``Exception``, or never returns: the item fails (or
expires) alone and the worker serves on; a call no deadline can stop ends the worker.

The worker runs as a real process (``tests.support.faultapp:user_code``) behind a real gateway.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError

from pipelines.errors import DeadlineExceeded
from pipelines.model import Item, Result, batch_deadline
from pipelines.registry import Registry
from pipelines.stages import GenerateIn, Stage
from runtime.status import stage_status
from tests.helpers import Harness, until
from tests.support.faultapp import RAISED, spawn, stop, user_code
from workers.contract import run_isolating
from workers.models.function import FunctionRunner
from workers.modelthread import HUNG_EXIT
from workers.settings import WorkerSettings

APP = "tests.support.faultapp:user_code"

# What each of RAISED answers: its type's name, in the client's error message.
NAMES = {
    "exit2": "SystemExit: 2",
    "exit0": "SystemExit: 0",
    "interrupt": "KeyboardInterrupt",
    "bare": "BaseException: bare",
    "generator": "GeneratorExit",
    "cancelled": "CancelledError",
}


@pytest.fixture
def worker_log(tmp_path: Path) -> Path:
    return tmp_path / "worker.log"


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for proc in started:
            stop(proc)


def _read(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


async def text_of(log: Path) -> str:
    """What ``log`` holds so far (read off the event loop)."""
    return await asyncio.to_thread(_read, log)


async def serving(
    log: Path, stages: str, procs: list[subprocess.Popen[bytes]], **env: str
) -> subprocess.Popen[bytes]:
    """A worker process serving ``stages`` of :data:`user_code`, reading."""
    proc = spawn("workers", stages, log=log, CONVEYOR_APP=APP, CONVEYOR_BLOCK_MS="100", **env)
    procs.append(proc)

    async def reading() -> bool:
        text = await text_of(log)
        assert proc.poll() is None, text
        return text.count(" reading ") >= len(stages.split(","))

    await until(reading, 120)
    return proc


async def call(
    http: httpx.AsyncClient, pipeline: str, kind: str, timeout_s: float
) -> httpx.Response:
    headers = {"X-Conveyor-Timeout": f"{timeout_s:g}"}
    return await http.post(f"/v1/{pipeline}", json={"kind": kind}, headers=headers, timeout=120)


async def test_steps_raising_what_is_no_exception_fail_alone_and_the_worker_serves_on(
    harness: Harness, redis: aioredis.Redis, worker_log: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    # Before: SystemExit(2) from a step ended the worker with status 2 (up: "a
    # configuration error", the whole service stopped); KeyboardInterrupt or a bare
    # BaseException crashed it; a CancelledError left the batch unanswered (504).
    stages = "raises.run,araises.run,routes.first,routes.next"
    proc = await serving(worker_log, stages, procs)
    http = await harness.gateway(Registry(user_code))
    cases = [(p, k) for p in ("raises", "araises") for k in RAISED]
    cases += [("routes", f"{where}:{k}") for where in ("route", "input") for k in RAISED]
    for pipeline, kind in cases:
        resp = await call(http, pipeline, kind, 60)
        log = await text_of(worker_log)
        assert proc.poll() is None, f"{pipeline} {kind}: the worker exited\n{log}"
        assert resp.status_code == 500, (pipeline, kind, resp.text)
        assert NAMES[kind.rpartition(":")[2]] in resp.json()["detail"], (pipeline, kind)
    for pipeline in ("raises", "araises", "routes"):  # the same process serves on
        resp = await call(http, pipeline, "ok", 60)
        assert (resp.status_code, resp.json()) == (200, {"kind": "ok"}), pipeline
    assert proc.poll() is None
    for stage in stages.split(","):
        assert await redis.xlen(harness.keys.dead_letters(stage)) == 0
        assert (await harness.stats(stage)).get("dead_letters", 0) == 0


async def test_an_async_step_awaiting_forever_expires_and_its_stage_serves_on(
    harness: Harness, worker_log: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    # Before: the call held the model thread for good: it got 504, and so did every
    # later call to the stage.
    await serving(worker_log, "araises.run", procs)
    http = await harness.gateway(Registry(user_code))
    assert (await call(http, "araises", "hang", 2)).status_code == 504

    async def expired() -> bool:  # cancelled at its deadline: ended by the worker
        return (await harness.stats("araises.run")).get("items:expired", 0) == 1

    await until(expired, 60)
    resp = await call(http, "araises", "ok", 60)
    assert (resp.status_code, resp.json()) == (200, {"kind": "ok"})


async def test_a_sync_step_running_past_its_deadline_and_the_grace_ends_the_worker(
    harness: Harness, redis: aioredis.Redis, worker_log: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    # Before: the worker lived on with its model thread taken for good, answering nothing.
    proc = await serving(worker_log, "raises.run", procs, CONVEYOR_HUNG_GRACE_S="1")
    http = await harness.gateway(Registry(user_code))
    # 5 s: time enough for a busy machine's worker to start the step before its deadline.
    assert (await call(http, "raises", "hang", 5)).status_code == 504

    async def exited() -> bool:
        return proc.poll() is not None

    await until(exited, 60)
    log = await text_of(worker_log)
    assert proc.returncode == HUNG_EXIT, log
    assert "ERROR workers.modelthread: stage raises.run: a batch of 1 hung" in log
    # Its item was answered (expired) and acked at its deadline, its call abandoned: a
    # function step's calls run apart, and nothing is left for recovery to run again.
    assert (await stage_status(redis, harness.keys, "raises.run")).pending == 0
    assert (await harness.stats("raises.run")).get("items:expired") == 1


class Raising:
    """Doubles ``value``; an item with ``raise`` raises that key of :data:`RAISED`."""

    def predict(self, items: list[Item]) -> list[Result]:
        for item in items:
            if "raise" in item:
                raise RAISED[item["raise"]]()
        return [{"value": item["value"] * 2} for item in items]


@pytest.mark.parametrize("kind", sorted(RAISED))
def test_an_item_raising_what_is_no_exception_fails_alone_in_its_batch(kind: str) -> None:
    items: list[Item] = [{"value": v} for v in range(5)]
    items[3] = {"value": 3, "raise": kind}
    try:
        results = run_isolating(Raising(), items)
    except BaseException as exc:  # the break: it escaped
        pytest.fail(f"run_isolating raised {exc!r}")
    assert isinstance(results[3], RAISED[kind]().__class__)
    assert [r for i, r in enumerate(results) if i != 3] == [{"value": 2 * v} for v in (0, 1, 2, 4)]


def test_an_async_function_step_is_cancelled_at_the_batch_deadline_alone() -> None:
    async def step(item: dict[str, Any]) -> dict[str, Any]:
        if item["kind"] == "hang":
            await asyncio.Event().wait()
        if item["kind"] == "cancelled":
            raise asyncio.CancelledError
        return {"kind": item["kind"]}

    runner = FunctionRunner(fn=step)
    items: list[Item] = [{"kind": "ok"}, {"kind": "hang"}, {"kind": "cancelled"}]
    try:
        with batch_deadline(time.monotonic() + 0.5):
            ok, hung, cancelled = runner.predict(items)
    finally:
        runner.close()
    assert ok == {"kind": "ok"}
    assert isinstance(hung, DeadlineExceeded)
    assert isinstance(cancelled, asyncio.CancelledError)  # its own: an error, not expired


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon"])
def test_the_hung_grace_is_validated(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_HUNG_GRACE_S", value)
    with pytest.raises(ValidationError, match="hung_grace_s"):
        WorkerSettings()
    assert WorkerSettings(hung_grace_s=0.5).hung_grace_s == 0.5


class BadStreamer:
    """Streams each text back; for ``int`` it emits a number (no text), for ``bare`` its
    ``predict_stream`` and ``predict`` raise a bare ``BaseException``."""

    def predict(self, items: list[Item]) -> list[Result]:
        if any(item["text"] == "bare" for item in items):
            raise BaseException("bare")
        return [{"generated_text": item["text"]} for item in items]

    def predict_stream(self, items: list[Item], emit: Callable[[int, str], None]) -> list[Result]:
        for i, item in enumerate(items):
            emit(i, 42 if item["text"] == "int" else item["text"])  # type: ignore[arg-type]
        return self.predict(items)


async def sse(http: httpx.AsyncClient, text: str) -> list[tuple[str, Any]]:
    events: list[tuple[str, Any]] = []
    async with http.stream("POST", "/v1/gen/stream", json={"text": text}) as resp:
        kind = ""
        async for line in resp.aiter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((kind, orjson.loads(line.removeprefix("data: "))))
    return events


async def test_a_streaming_model_s_bad_emit_or_base_exception_fails_its_item_alone(
    harness: Harness,
) -> None:
    # Before: a number emitted as text failed the partials' drain, and a bare
    # BaseException the batch task: either way the worker stopped.
    stage = Stage("gen", GenerateIn, runner="unused", streaming=True)
    worker = harness.worker(stage, BadStreamer())
    await worker.start()
    task = harness.run(worker)
    base = await harness.http_server([stage])
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        # The emit refused in the model's call: the item runs again without streaming.
        assert (await sse(http, "int"))[-1] == ("done", {"generated_text": "int"})
        kind, data = (await sse(http, "bare"))[-1]
        assert (kind, data["status"]) == ("error", 500), data
        assert "BaseException: bare" in data["detail"]
        assert not task.done(), task
        assert (await sse(http, "fine"))[-1] == ("done", {"generated_text": "fine"})
