"""A model that breaks the batch contract is said and counted, then isolated as before
(issue 29, item 5): one ERROR line a minute per stage, naming the stage, the runner and
both counts; ``conveyor_stage_contract_errors_total``; the status snapshot."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from pipelines.stages import Stage
from tests.helpers import Harness, NumberIn
from tests.support.faultapp import ShortByOne


def _breach_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and "broke the batch contract" in r.getMessage()
    ]


def _counter(metrics: str) -> int:
    series = 'conveyor_stage_contract_errors_total{stage="short"} '
    (line,) = [m for m in metrics.splitlines() if m.startswith(series)]
    return int(float(line.split()[-1]))


async def test_a_batch_one_result_short_is_said_counted_and_isolated(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    # BREAK (issue 29, Why 5): every request got 200 and the log said batch=N ok=N; the
    # batch was split down to single items and nothing said so.
    caplog.set_level(logging.INFO)
    stage = Stage("short", NumberIn, "tests.support.faultapp:ShortByOne", batch_wait_ms=300)
    worker = harness.worker(stage, ShortByOne())
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([stage])
    for round_ in range(2):
        values = [10 * round_ + i for i in range(8)]
        resps = await asyncio.gather(*(http.post("/v1/short", json={"value": v}) for v in values))
        assert [r.status_code for r in resps] == [200] * 8  # isolated: each item answered
        assert sorted(r.json()["value"] for r in resps) == sorted(2 * v for v in values)
        if round_ == 0:
            counted = _counter((await http.get("/metrics")).text)
            assert counted >= 1
    assert max(r.size for r in worker.history) >= 2  # a batch of several did run
    # Rate-limited: one line for both rounds (the second round is counted, not said).
    (line,) = _breach_lines(caplog)
    assert "stage short" in line
    assert "tests.support.faultapp:ShortByOne" in line
    got = re.search(r"(\d+) items, (\d+) results", line)
    assert got is not None, line
    assert int(got[2]) == int(got[1]) - 1
    total = _counter((await http.get("/metrics")).text)
    assert total > counted  # the second round's breaches counted though not logged
    (row,) = (await http.get("/status.json")).json()["stages"]
    assert row["contract_errors"] == total


async def test_a_result_that_is_not_an_object_is_said_and_counted(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    stage = Stage("short", NumberIn, "tests.support.faultapp:ShortByOne", batch_wait_ms=0)
    worker = harness.worker(stage, ShortByOne(), max_batch_size=1)
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([stage])
    assert (await http.post("/v1/short", json={"value": 3})).status_code == 200
    assert _counter((await http.get("/metrics")).text) == 0
    assert (await http.post("/v1/short", json={"value": -1})).status_code == 500
    assert _counter((await http.get("/metrics")).text) == 1
    (line,) = _breach_lines(caplog)
    assert "stage short" in line
    assert "a result is str" in line
