"""Round four, lesser (i) (issue 36): each distinct crashing input cost three worker
restarts (three model loads): the crash in its batch, the crash of the batch's whole
re-run, the crash alone. Now the entries of a crashed batch run again in a short-lived
child process forked from the worker (:mod:`workers.suspects`): the input that kills is
found there by halving, dead-lettered and answered, and costs the one restart of its
first crash.

Real processes and a real redis-server; each test fails on the code before the fix.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis.asyncio as aioredis

from pipelines.envelope import decode_replies, decode_request
from pipelines.graph import single
from pipelines.keys import Keys
from pipelines.model import Item, Result
from pipelines.records import DeadLetter
from pipelines.registry import Registry
from pipelines.stages import BUILTIN
from runtime.status import stage_status
from tests.conveyor.test_supervisor import start_ready, stop
from tests.helpers import Doubler, Harness, died_running, number_stage, replies_in, until
from workers.claims import mark_hung
from workers.forked import decode_results, fork_running, wait_child
from workers.route import Router
from workers.runner import Runner
from workers.settings import WorkerSettings
from workers.suspects import Isolation
from workers.values import Entry

FAST_RECLAIM = {
    "CONVEYOR_MIN_IDLE_MS": "300",
    "CONVEYOR_RECLAIM_INTERVAL_MS": "50",
    "CONVEYOR_BLOCK_MS": "100",
    "CONVEYOR_RESTART_BACKOFF_S": "0.1",
}


class KillsItsProcess:
    """Doubles values; a negative one ends the process it runs in (``os._exit``), as a
    segfault would. In the process that built it (the serving worker, here the test's)
    it raises instead, so the code before the fix fails this test rather than ending it."""

    def __init__(self) -> None:
        self.home = os.getpid()
        self.batches: list[list[int]] = []

    def predict(self, items: list[Item]) -> list[Result]:
        """Double, or die."""
        self.batches.append([item["value"] for item in items])
        if any(item["value"] < 0 for item in items):
            if os.getpid() == self.home:
                raise RuntimeError("the serving worker's process would have died here")
            os._exit(9)
        return [{"value": item["value"] * 2} for item in items]


async def test_a_crashed_batch_runs_in_a_child_and_only_the_poison_is_dead_lettered(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage(max_batch_size=32, batch_wait_ms=0)
    stream = harness.keys.stage_stream("double")
    model = KillsItsProcess()
    # An idle time the worker's own lease keeps its running entries under, on a loaded
    # machine too (at 10 ms it took its own suspects back and ran them twice).
    worker = harness.worker(stage, model, min_idle_ms=500, reclaim_interval_ms=10)
    await worker.start()
    values = [1, 2, -1, 3]
    sent = await harness.enqueue("double", [{"value": v} for v in values])
    await died_running(redis, harness.keys, stream)  # the batch's first crash
    running = harness.run(worker)
    replies = harness.keys.reply_stream("test")

    async def answered() -> bool:
        return bool(await replies_in(redis, replies) >= len(values))

    await until(answered, 30)
    worker.stop()
    await running
    got = {
        r.id: r
        for r in (
            one for _, f in cast(Any, await redis.xrange(replies)) for one in decode_replies(f)
        )
    }
    for req, value in zip(sent, values, strict=True):
        reply = got[req.id]
        if value < 0:
            assert (reply.outcome, reply.status) == ("error", 500), reply
            assert "dead-lettered" in (reply.error or ""), reply
            assert "ended its model process (exited (9))" in (reply.error or ""), reply
        else:
            assert (reply.outcome, reply.result) == ("ok", {"value": 2 * value}), reply
    letters = cast(list[Any], await redis.xrange(harness.keys.dead_letters("double")))
    assert len(letters) == 1, letters
    assert decode_request(letters[0][1]).id == sent[2].id
    assert "exited (9)" in (DeadLetter.parse(letters[0][1]).error or "")
    assert (await harness.stats("double")).get("dead_letters") == 1
    assert (await stage_status(redis, harness.keys, "double")).pending == 0
    # The whole batch, then halves, down to the poison alone: every run in a child.
    assert worker.parts.isolation.children == 5
    assert model.batches == [], model.batches  # none in the serving process


def restarts(log: Path, stage: str) -> int:
    """How many times ``up`` restarted ``stage``'s worker after it ended unasked."""
    return len(re.findall(rf"worker {re.escape(stage)}\b.*; restarting it in", log.read_text()))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("quarantine_s", ["0", "600"])
async def test_each_crashing_input_costs_one_worker_restart(
    tmp_path: Path, redis_url: str, namespace: str, quarantine_s: str
) -> None:
    # BREAK (issue 36, lesser i): each distinct crashing input cost three restarts of
    # its worker (three model loads), and one such input a second kept the stage from
    # answering at all. Now a poison costs the restart of its own first crash: its
    # batch runs again in a child, where the poison is found and dead-lettered. And
    # within CONVEYOR_QUARANTINE_S of that crash every batch runs in a child: the
    # poisons that follow cost no restart at all (found by the outside re-run: 30
    # distinct poisons, one a second, still cost 13 restarts).
    env = {**FAST_RECLAIM, "CONVEYOR_QUARANTINE_S": quarantine_s}
    up, log, base = start_ready(tmp_path, redis_url, namespace, *("--pipelines", "crashy"), **env)
    quarantined = quarantine_s != "0"
    keys = Keys(namespace)
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=200) as http:
            headers = {"X-Conveyor-Timeout": "120"}
            # Three poisoned batches in a row, each one poison among innocents (-1: the
            # model SIGKILLs its process; -2: it exits 2, as a configuration error would).
            for n, poison in enumerate((-1, -2, -1)):
                values = [10 * n + 1, 10 * n + 2, poison, 10 * n + 3, 10 * n + 4]
                calls = [
                    http.post("/v1/crashy", json={"value": v}, headers=headers) for v in values
                ]
                got = await asyncio.gather(*calls)
                for value, resp in zip(values, got, strict=True):
                    if value < 0:
                        assert resp.status_code == 500, resp.text
                        assert "dead-lettered" in resp.json()["detail"], resp.text
                    else:
                        assert resp.status_code == 200, resp.text
                        assert resp.json() == {"value": 2 * value}
                # One restart per poisoned batch, not three; in quarantine, the first only.
                assert restarts(log, "crashy") == (1 if quarantined else n + 1), log.read_text()
        assert up.poll() is None, log.read_text()
        assert await client.xlen(keys.dead_letters("crashy")) == 3
    finally:
        await client.aclose()
        code = stop(up)
    assert code == 0, log.read_text()
    assert restarts(log, "crashy") == (1 if quarantined else 3), log.read_text()


async def test_a_real_torch_model_runs_in_a_child_forked_after_it_ran_in_its_thread() -> None:
    # Forking a process whose torch has run (its OpenMP threads made, a tokenizer used)
    # must not deadlock the child: it answers what the worker itself answers.
    stage = BUILTIN["ner"]  # a tiny random-weight BERT and a real tokenizer
    settings = WorkerSettings(device="cpu", threads=2)
    runner = Runner(stage, settings, None)
    await runner.load()
    try:
        items = [{"text": "Angela Merkel met Barack Obama in Berlin"}, {"text": "Paris"}]
        model = runner.model
        assert model is not None
        mine = await asyncio.to_thread(model.predict, items)
        for _ in range(2):
            pid, fd = fork_running(model, items, time.monotonic() + 60)
            try:
                status, data = await wait_child(pid, fd, 60)
            finally:
                os.close(fd)
            assert status == 0, status
            assert decode_results(data, len(items)) == list(mine)
    finally:
        runner.close()


class OnAnAccelerator(Doubler):
    """Says it runs on an accelerator (as a model on CUDA does, which cannot be forked)."""

    accelerated = True


@pytest.mark.parametrize(
    ("model", "in_child", "usable"),
    [(Doubler(), True, True), (Doubler(), False, False), (OnAnAccelerator(), True, False)],
)
def test_suspects_run_in_the_worker_where_a_fork_is_not_safe_or_not_wanted(
    model: Doubler, in_child: bool, usable: bool
) -> None:
    stage = number_stage()
    settings = WorkerSettings(suspects_in_child=in_child)
    runner = Runner(stage, settings, model)
    try:
        router = Router(Registry([single(stage)]), Keys("t"), stage.name)
        isolation = Isolation(runner, router, cast(Any, None), "c", settings)
        assert isolation.usable is usable
    finally:
        runner.close()


class SlowInAChild(KillsItsProcess):
    """As :class:`KillsItsProcess`, taking a second a batch in a child process."""

    def predict(self, items: list[Item]) -> list[Result]:
        """Wait a second in a child, then double (or die)."""
        if os.getpid() != self.home:
            time.sleep(1.0)
        return super().predict(items)


async def test_suspects_running_in_a_child_are_not_charged_a_crash_of_their_worker(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # While a child runs them, the suspects' marks still say "queued for a re-run": had
    # the worker died meanwhile (another input's crash in a batch of its own), they are
    # taken back uncharged, never dead-lettered for a crash they were not in.
    stage = number_stage(max_batch_size=32, batch_wait_ms=0)
    stream = harness.keys.stage_stream("double")
    worker = harness.worker(stage, SlowInAChild(), min_idle_ms=500, reclaim_interval_ms=10)
    await worker.start()
    await harness.enqueue("double", [{"value": v} for v in (1, 2, 3)])
    await died_running(redis, harness.keys, stream)
    running = harness.run(worker)

    async def in_a_child() -> bool:
        return worker.parts.isolation.children >= 1

    await until(in_a_child, 30)
    marks = cast(dict[bytes, bytes], await redis.hgetall(harness.keys.on_model(stream)))
    assert len(marks) == 3, marks
    assert all(m.startswith(b"q") for m in marks.values()), marks

    async def answered() -> bool:
        return bool(await replies_in(redis, harness.keys.reply_stream("test")) >= 3)

    await until(answered, 30)
    worker.stop()
    await running
    assert not await redis.exists(harness.keys.on_model(stream))  # deleted with the acks


FORK_AFTER_MAIN_THREAD_TORCH = """
import asyncio, os, time
import torch
from workers.forked import decode_results, fork_running, wait_child

torch.set_num_threads(2)
torch.ones(512, 512) @ torch.ones(512, 512)  # the forking thread starts OpenMP's pool


class Sums:
    def predict(self, items):
        return [{"sum": float((torch.ones(256, 256) @ torch.ones(256, 256)).sum())} for _ in items]


async def main():
    pid, fd = fork_running(Sums(), [{}, {}], time.monotonic() + 30)
    try:
        status, data = await wait_child(pid, fd, 30)
    finally:
        os.close(fd)
    print(status, decode_results(data, 2) if status == 0 else None)


asyncio.run(main())
"""


async def test_a_child_forked_from_a_thread_that_ran_torch_does_not_hang() -> None:
    # An app that builds or runs a module at import runs torch on the worker's main
    # thread, the one that forks: a child that used OpenMP's pool as it was hung there.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        FORK_AFTER_MAIN_THREAD_TORCH,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode()
    assert proc.returncode == 0, text
    assert text.strip().splitlines()[-1] == "0 [{'sum': 16777216.0}, {'sum': 16777216.0}]", text


class HangsInAChild:
    """Doubles values; a negative one never returns in a child (the serving worker's
    own process raises instead, so a run there fails the test rather than hanging it)."""

    def __init__(self) -> None:
        self.home = os.getpid()

    def predict(self, items: list[Item]) -> list[Result]:
        """Double, or hang."""
        if any(item["value"] < 0 for item in items):
            if os.getpid() == self.home:
                raise RuntimeError("the serving worker would have hung here")
            time.sleep(600)
        return [{"value": item["value"] * 2} for item in items]


async def test_a_batch_that_hung_runs_each_item_in_a_child_of_its_own(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # BREAK (round four, re-run): a hang batched with 10 others was found by halves in
    # children, each level waiting max_call_s out (7 -> 3 -> 1: three more bounds), and
    # the innocents' callers had given up by then. Now a batch that hung runs each item
    # in a child of its own: the hang costs its bound once more, alone, and every other
    # item answers beside it.
    stage = number_stage(max_batch_size=32, batch_wait_ms=0)
    stream = harness.keys.stage_stream("double")
    worker = harness.worker(
        stage, HangsInAChild(), min_idle_ms=500, reclaim_interval_ms=10, max_call_s=2
    )
    await worker.start()
    values = [1, 2, 3, -1, 4, 5, 6, 7]
    sent = await harness.enqueue("double", [{"value": v} for v in values])
    got = await died_running(redis, harness.keys, stream)
    entries = [Entry(eid, fields, stream) for _, read in got for eid, fields in read]
    await mark_hung(redis, harness.keys, entries)  # as the worker whose call hung left it
    running = harness.run(worker)
    replies = harness.keys.reply_stream("test")

    async def answered() -> bool:
        return bool(await replies_in(redis, replies) >= len(values))

    await until(answered, 60)
    worker.stop()
    await running
    got_replies = [
        one for _, f in cast(Any, await redis.xrange(replies)) for one in decode_replies(f)
    ]
    by_id = {r.id: r for r in got_replies}
    for req, value in zip(sent, values, strict=True):
        reply = by_id[req.id]
        if value < 0:
            assert (reply.outcome, reply.status) == ("error", 504), reply
            assert "max_call_s" in (reply.error or ""), reply
        else:
            assert (reply.outcome, reply.result) == ("ok", {"value": 2 * value}), reply
    # Recovery halves a hung batch (4 + 4); each half's items then run one a child:
    # 8 children, and one bound waited out (halves in children would be 4 + 2 + 2 + ...).
    assert worker.parts.isolation.children == len(values)
