"""Logs of real processes: CONVEYOR_LOG_LEVEL and CONVEYOR_LOG_FORMAT, the per-batch lines
at DEBUG only, the per-stage summary at INFO, and no progress bars (docs/logs.md)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from runtime.logs import LogSettings
from tests.helpers import (
    REPO,
    GatewayProcess,
    Harness,
    replies_in,
    until,
    wait_for_line,
    worker_process,
)
from tests.support.faultapp import stop
from workers.report import Summary
from workers.values import BatchRecord

ITEMS = 40
SUMMARY_FIELDS = {"stage", "batches", "items", "ok", "error", "expired", "cancelled"}
SUMMARY_FIELDS |= {"mean_batch", "items_per_s", "run_ms_mean", "span_s"}


def start_worker(stages: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """A real ``python -m workers STAGES`` from this checkout, its output to ``log``."""
    return worker_process(log, env | {"PYTHONPATH": str(REPO)}, stages)


def parsed(text: str) -> list[dict[str, Any]]:
    """Each line of ``text`` as JSON (a line that is not fails the test, shown)."""
    lines = []
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}\n{text}")
    return lines


async def served_log(
    harness: Harness, redis: aioredis.Redis, log: Path, **env: str
) -> tuple[list[str], str]:
    """The trace ids of :data:`ITEMS` requests, and what a real ``slow`` worker
    (``CONVEYOR_LOG_FORMAT=json`` and ``env``) wrote to stderr while it answered them and
    wrote its INFO summary of them."""
    sent = await harness.enqueue("slow", [{"value": i} for i in range(ITEMS)])
    settings = {"CONVEYOR_APP": "tests.support.faultapp:pipelines", "CONVEYOR_LOG_FORMAT": "json"}
    settings |= {"CONVEYOR_LOG_SUMMARY_S": "0.5", "CONVEYOR_MAX_BATCH_SIZE": "8"}
    worker = start_worker("slow", os.environ | settings | env, log)
    try:

        async def answered() -> bool:
            return bool(await replies_in(redis, harness.keys.reply_stream("test")) >= ITEMS)

        async def summarised() -> bool:
            text = await asyncio.to_thread(log.read_text)
            assert worker.poll() is None, text
            return '"summary": true' in text

        await until(answered, limit_s=120)
        await until(summarised, limit_s=60)  # its window (0.5 s) closes on an idle read
    finally:
        stop(worker)
    return [r.trace_id for r in sent], await asyncio.to_thread(log.read_text)


async def test_at_info_a_json_worker_writes_a_summary_and_no_batch_lines_nor_trace_ids(
    harness: Harness, redis: aioredis.Redis, tmp_path: Path
) -> None:
    traces, text = await served_log(harness, redis, tmp_path / "w.log")
    lines = parsed(text)
    summaries = [line for line in lines if line.get("summary")]
    for line in summaries:
        assert line.keys() >= SUMMARY_FIELDS, line
        assert (line["level"], line["logger"], line["stage"]) == ("INFO", "workers.report", "slow")
        assert line["items_per_s"] > 0, line
        assert line["mean_batch"] >= 1, line
        assert {"time", "message"} <= line.keys()
    assert sum(line["items"] for line in summaries) == ITEMS
    assert sum(line["ok"] for line in summaries) == ITEMS
    assert sum(line["batches"] for line in summaries) >= ITEMS // 8
    assert not [line for line in lines if "batch=" in line["message"] or "trace_ids" in line]
    assert not [t for t in traces if t in text]


async def test_at_debug_each_batch_has_its_line_with_its_fields_and_trace_ids(
    harness: Harness, redis: aioredis.Redis, tmp_path: Path
) -> None:
    log = tmp_path / "w.log"
    traces, text = await served_log(harness, redis, log, CONVEYOR_LOG_LEVEL="debug")
    batches = [line for line in parsed(text) if "batch" in line and "trace_ids" in line]
    for line in batches:
        assert (line["level"], line["stage"]) == ("DEBUG", "slow"), line
        assert line["batch"] == line["ok"] == len(line["trace_ids"]), line
        assert {"error", "expired", "cancelled", "run_ms", "wait_max_ms"} <= line.keys()
        assert line["message"].startswith(f"stage slow batch={line['batch']} ok=")
    assert sum(line["batch"] for line in batches) == ITEMS
    assert sorted(t for line in batches for t in line["trace_ids"]) == sorted(traces)


async def test_a_model_load_writes_no_progress_bar(env: None, tmp_path: Path) -> None:
    # The built-in embed stage loads MiniLM with transformers, whose loader draws a
    # "Loading weights" bar on stderr.
    quiet = ("CONVEYOR_APP", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY")
    environ = {k: v for k, v in os.environ.items() if k not in quiet}
    environ |= {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "embed.log"
    worker = start_worker("embed", environ, log)
    try:
        text = await asyncio.to_thread(wait_for_line, log, "stage embed: consumer", worker)
    finally:
        stop(worker)
    assert "model minilm ready" in text
    for bar in ("Loading weights", "it/s", "\r"):
        assert bar not in text, text


@pytest.mark.parametrize("module", ["workers", "gateway"])
@pytest.mark.parametrize("name", ["CONVEYOR_LOG_LEVEL", "CONVEYOR_LOG_FORMAT"])
def test_a_bad_log_setting_is_one_line_naming_it(
    redis_url: str, tmp_path: Path, module: str, name: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env |= {"PYTHONPATH": str(REPO), "CONVEYOR_APP": "tests.support.faultapp:pipelines"}
    env |= {"CONVEYOR_REDIS_URL": redis_url, "CONVEYOR_NAMESPACE": "badlog", name: "loud"}
    argv = [sys.executable, "-m", module, *(["slow"] if module == "workers" else [])]
    # Before any setting was read, a worker or a gateway would serve on: no exit in time.
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"conveyor: {name}: "), line
    assert "'loud'" in line


def test_a_json_gateway_writes_only_json_lines_uvicorns_too(redis_url: str, tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    with GatewayProcess(redis_url, log, CONVEYOR_LOG_FORMAT="json"):
        pass
    lines = parsed(log.read_text())
    assert any(line["logger"].startswith("uvicorn") for line in lines), lines
    assert {"time", "level", "logger", "message"} <= lines[0].keys()


def test_log_settings_take_any_case() -> None:
    assert LogSettings(level="debug", format="JSON").model_dump() == {
        "level": "DEBUG",
        "format": "json",
    }


class Clock:
    """A clock a test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_summary_covers_its_interval_and_says_nothing_when_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    summary = Summary("s", 30.0, clock)

    def batch(size: int) -> BatchRecord:
        record = BatchRecord(size=size, oldest_ms=0, closed_at=0.0, run_s=0.01)
        record.outcomes.update({"ok": size - 1, "error": 1})
        return record

    def said() -> list[dict[str, Any]]:
        return [r.__dict__ for r in caplog.records if r.name == "workers.report"]

    with caplog.at_level("INFO", logger="workers.report"):
        clock.now += 3600  # an hour idle: nothing said, and not counted in the next
        summary.tick()
        assert said() == []
        summary.add(batch(4))
        clock.now += 10
        summary.add(batch(8))
        assert said() == []  # its interval is not over
        clock.now += 20
        summary.tick()
        (line,) = said()
        assert (line["batches"], line["items"], line["ok"], line["error"]) == (2, 12, 10, 2)
        assert (line["mean_batch"], line["items_per_s"], line["span_s"]) == (6, 0.4, 30)
        clock.now += 600
        summary.tick()  # idle since: nothing more
        assert len(said()) == 1
        summary.add(batch(6))  # after ten idle minutes: its line covers from here
        clock.now += 30
        summary.tick()
        assert (said()[1]["items"], said()[1]["items_per_s"], said()[1]["span_s"]) == (6, 0.2, 30)
        summary.add(batch(2))
        summary.tick(last=True)  # a stopping worker says what it counted
        assert said()[2]["items"] == 2
