"""Continuous batching in the generate stage (workers/decoding.py, workers/models/decoder.py):
generations join and leave the running batch between decoding steps. Real Redis, real HTTP
through the gateway, the built-in tiny GPT-2, a real worker process killed mid-generation."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from pipelines.outcomes import Outcome
from pipelines.stages import BUILTIN
from runtime.jobs import mark_cancelled
from tests.helpers import REPO, Harness, beating, died_running, read_sse, until
from tests.support.tinyllama import tiny_llama
from workers.loop import Worker
from workers.models import blocks
from workers.models.decoder import Decoder, Generation
from workers.models.hf import Generator

GENERATE = BUILTIN["generate"]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "into"]


@pytest.fixture(scope="module")
def generator(cache_dir: Path) -> Generator:
    return Generator(model="tiny:generate", device="cpu", cache_dir=str(cache_dir))


def prompts(count: int, seed: int) -> list[str]:
    pick = random.Random(seed)
    return [" ".join(pick.choices(WORDS, k=pick.randint(1, 30))) for _ in range(count)]


def test_greedy_output_is_the_prompt_decoded_alone_whoever_joins_and_leaves(
    generator: Generator,
) -> None:
    pick = random.Random(3)
    texts = prompts(16, seed=3)
    limits = [pick.choice([1, 3, 8, 40, 150]) for _ in texts]
    items = [{"text": t, "max_new_tokens": n} for t, n in zip(texts, limits, strict=True)]
    alone = [generator.generate_ids([item])[0] for item in items]
    decoder = Decoder(generator, budget=100_000)
    generations = [s for s in decoder.open(items) if not isinstance(s, BaseException)]
    waiting, steps, widest = list(generations), 0, 0
    while waiting or decoder.rows:
        if waiting and steps % 4 == 0:  # a few join every fourth step; others end
            count = pick.randint(1, 3)
            joining, waiting = waiting[:count], waiting[count:]
            decoder.prefill(joining)
        decoder.advance()
        widest = max(widest, len(decoder.rows))
        steps += 1
    assert widest > 1  # they did run side by side
    assert [s.ids for s in generations] == alone
    assert all(s.reason in {"stop", "length"} for s in generations)


def test_a_cache_grown_in_blocks_decodes_as_alone_too(
    generator: Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tiny model's cache is below the size that grows in blocks: made to, here, and
    # its 150-token generations cross several blocks.
    monkeypatch.setattr(blocks, "BLOCKS_FROM", 0)
    test_greedy_output_is_the_prompt_decoded_alone_whoever_joins_and_leaves(generator)


def test_a_rotary_model_decodes_as_alone_too(generator: Generator, tmp_path: Path) -> None:
    # A tiny Llama (rotary positions, grouped-query attention), random weights, saved
    # beside the tiny GPT-2's tokenizer and loaded as any user's model folder is.
    llama = tiny_llama(generator, tmp_path)
    items = [{"text": t, "max_new_tokens": 25} for t in prompts(6, seed=9)]
    alone = [llama.generate_ids([item])[0] for item in items]
    decoder = llama.continuous_decoder(100_000)
    assert decoder is not None
    generations = [s for s in decoder.open(items) if not isinstance(s, BaseException)]
    decoder.prefill(generations[:2])
    for step in range(200):
        if step in (3, 7) and len(generations) > 2:  # two join mid-way, one at a time
            decoder.prefill([generations[2 + (step == 7)]])
        if step == 11:
            decoder.prefill(generations[4:])
        if not decoder.rows and step > 11:
            break
        decoder.advance()
    assert [s.ids for s in generations] == alone


def test_the_budget_bounds_rows_times_the_longest_reservation(generator: Generator) -> None:
    decoder = Decoder(generator, budget=120)
    first, second, third = decoder.open([{"text": "a b", "max_new_tokens": 30}] * 3)
    assert not isinstance(first, BaseException)
    assert not isinstance(second, BaseException)
    assert not isinstance(third, BaseException)
    reserved = first.reserved  # its prompt's tokens and its 30 new ones
    assert decoder.fits(first)
    decoder.prefill([first])
    assert decoder.fits(second) == (2 * reserved <= 120)
    decoder.prefill([second])
    assert not decoder.fits(third) or 3 * reserved <= 120
    assert decoder.fits(third) == (3 * reserved <= 120)


def test_a_seeded_request_samples_the_same_text_beside_any_others(generator: Generator) -> None:
    asked = {"text": "the cat", "max_new_tokens": 30, "temperature": 0.9, "seed": 11}
    runs = []
    for company in (0, 3, 7):
        decoder = Decoder(generator, budget=100_000)
        others = [
            {"text": t, "max_new_tokens": 20, "temperature": 1.0} for t in prompts(company, 5)
        ]
        opened = decoder.open([*others, asked])
        decoder.prefill([s for s in opened if not isinstance(s, BaseException)])
        while decoder.rows:
            decoder.advance()
        mine = opened[-1]
        assert not isinstance(mine, BaseException)
        runs.append(mine.ids)
    assert runs[0] == runs[1] == runs[2]
    other_seed = Decoder(generator, budget=100_000)
    (differs,) = other_seed.open([{**asked, "seed": 12}])
    assert not isinstance(differs, BaseException)
    other_seed.prefill([differs])
    while other_seed.rows:
        other_seed.advance()
    assert differs.ids != runs[0]


def test_a_request_that_can_never_fit_the_budget_is_refused_naming_the_setting(
    generator: Generator,
) -> None:
    decoder = Decoder(generator, budget=64)
    fits, never = decoder.open(
        [{"text": "a", "max_new_tokens": 10}, {"text": "a b c", "max_new_tokens": 100}]
    )
    assert not isinstance(fits, BaseException)
    assert isinstance(never, Exception)
    assert "CONVEYOR_DECODE_TOKEN_BUDGET" in str(never)
    assert str(never).startswith("item 1:") or "max_new_tokens" in str(never)


async def served(harness: Harness, **settings: Any) -> tuple[Worker, str]:
    worker = harness.worker(GENERATE, device="cpu", **settings)
    await worker.start()
    harness.run(worker)
    return worker, await harness.http_server([GENERATE])


@pytest.mark.parametrize("decoding", ["continuous", "static"])
async def test_a_short_request_sent_while_a_long_one_generates_is_answered_first(
    harness: Harness, decoding: str
) -> None:
    _, base = await served(harness, decoding=decoding)
    order: list[str] = []
    started = asyncio.Event()
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:

        async def long() -> None:
            body = {"text": "once", "max_new_tokens": 400}
            async with http.stream("POST", "/v1/generate/stream", json=body) as resp:
                events = await read_sse(resp, started.set)
            assert events[-1][0] == "done"
            order.append("long")

        async def short() -> None:
            await started.wait()  # the long one is generating
            resp = await http.post("/v1/generate", json={"text": "hi", "max_new_tokens": 4})
            assert resp.status_code == 200, resp.text
            order.append("short")

        await asyncio.gather(long(), short())
    # Static batching makes it wait for the long batch; continuous joins it at once.
    assert order == (["short", "long"] if decoding == "continuous" else ["long", "short"])


async def test_a_client_that_goes_away_mid_stream_frees_its_slot(harness: Harness) -> None:
    worker, base = await served(harness, max_batch_size=1)
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        tokens = 0
        body = {"text": "once", "max_new_tokens": 400}
        async with http.stream("POST", "/v1/generate/stream", json=body) as resp:
            async for line in resp.aiter_lines():
                tokens += line.startswith("event: token")
                if tokens == 3:
                    break  # the client leaves: its request is cancelled
        # One slot: the next request runs only once the cancelled one has left it.
        resp = await http.post("/v1/generate", json={"text": "hi", "max_new_tokens": 4})
        assert resp.status_code == 200, resp.text

    async def counted() -> bool:
        return sum(r.outcomes[Outcome.CANCELLED] for r in worker.history) == 1

    await until(counted, 30)
    left = next(r for r in worker.history if r.outcomes[Outcome.CANCELLED])
    assert 3 <= left.generated < 400  # it left the running batch mid-way


@pytest.mark.parametrize("decoding", ["continuous", "static"])
async def test_a_request_cancelled_before_its_turn_never_runs(
    harness: Harness, decoding: str
) -> None:
    # Cancelled while it waited in the stream (a client gone before a slot was free): the
    # worker reads it, and the model must not start it. Continuous decoding used to prefill
    # and step it until the next cancellation check (every CHECK_S), as many as had slots.
    worker = harness.worker(GENERATE, device="cpu", decoding=decoding)
    await worker.start()
    (request,) = await harness.enqueue("generate", [{"text": "once", "max_new_tokens": 400}])
    await mark_cancelled(harness.redis, harness.keys, request.id, request.deadline, time.time())
    harness.run(worker)

    async def answered() -> bool:
        return any(r.outcomes[Outcome.CANCELLED] for r in worker.history)

    await until(answered, 30)
    (record,) = [r for r in worker.history if r.outcomes[Outcome.CANCELLED]]
    assert (record.generated, record.run_s) == (0, 0.0)  # no prefill, no step: no model time


async def test_a_request_past_its_deadline_leaves_the_batch_with_504(harness: Harness) -> None:
    worker, base = await served(harness)
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        await http.post("/v1/generate", json={"text": "warm", "max_new_tokens": 2})
        headers = {"X-Conveyor-Timeout": "0.3"}
        body = {"text": "once", "max_new_tokens": 400}
        slow = asyncio.create_task(http.post("/v1/generate", json=body, headers=headers))
        # Beside it, a request with time: it is not held up by the expiring one.
        fine = await http.post("/v1/generate", json={"text": "hi", "max_new_tokens": 300})
        late = await slow
    assert fine.status_code == 200, fine.text
    assert late.status_code == 504, late.text

    async def counted() -> bool:
        return sum(r.outcomes[Outcome.EXPIRED] for r in worker.history) == 1

    await until(counted, 30)
    left = next(r for r in worker.history if r.outcomes[Outcome.EXPIRED])
    assert left.generated < 400  # it left the running batch mid-way


async def test_interactive_requests_take_a_free_slot_before_bulk(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Two slots; bulk's reserve is one of them (CONVEYOR_BULK_EVERY): a bulk request
    # holds it, an interactive one the other. Queued meanwhile: bulk, then interactive.
    # When the interactive slot frees, the queued interactive request takes it, and the
    # queued bulk one waits for the bulk slot.
    _, base = await served(harness, max_batch_size=2)
    order: list[str] = []
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:

        async def call(lane: str, tokens: int, name: str = "", started: Any = None) -> None:
            headers = {"X-Conveyor-Priority": lane}
            body = {"text": lane, "max_new_tokens": tokens}
            stream = http.stream("POST", "/v1/generate/stream", json=body, headers=headers)
            async with stream as resp:
                events = await read_sse(resp, started.set if started else lambda: None)
            assert events[-1][0] == "done", events[-1]
            order.append(name or lane)

        held = [asyncio.Event(), asyncio.Event()]
        running = [
            asyncio.create_task(call("bulk", 450, "long bulk", held[0])),
            asyncio.create_task(call("interactive", 150, "long interactive", held[1])),
        ]
        await asyncio.gather(*(e.wait() for e in held))  # both slots taken
        queued_bulk = asyncio.create_task(call("bulk", 2))
        bulk_stream = harness.keys.stage_stream(GENERATE.name, "bulk")

        async def queued() -> bool:  # the long bulk request's entry, and this one's
            return int(await redis.xlen(bulk_stream)) == 2

        await until(queued, 30)
        queued_interactive = asyncio.create_task(call("interactive", 2))
        await asyncio.gather(queued_interactive, queued_bulk, *running)
    assert order.index("interactive") < order.index("bulk"), order


def worker_process(log: Path, **env: str) -> subprocess.Popen[bytes]:
    full = dict(os.environ) | {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"} | env
    with log.open("ab") as out:
        argv = [sys.executable, "-m", "workers", "generate"]
        return subprocess.Popen(argv, env=full, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


async def test_a_worker_killed_mid_generation_its_stream_goes_on_each_token_once(
    harness: Harness, redis: aioredis.Redis, tmp_path: Path, generator: Generator
) -> None:
    fast = {
        "CONVEYOR_MIN_IDLE_MS": "500",
        "CONVEYOR_RECLAIM_INTERVAL_MS": "50",
        "CONVEYOR_BLOCK_MS": "100",
        "CONVEYOR_DEVICE": "cpu",
    }
    log = tmp_path / "workers.log"
    base = await harness.http_server([GENERATE])
    first = worker_process(log, **fast)
    second: subprocess.Popen[bytes] | None = None
    body = {"text": "once upon a time", "max_new_tokens": 400}
    try:
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            ready = await http.post("/v1/generate", json={"text": "warm", "max_new_tokens": 2})
            assert ready.status_code == 200, ready.text
            tokens = 0

            def kill_after_some() -> None:
                nonlocal second
                nonlocal tokens
                tokens += 1
                if tokens == 5:
                    first.send_signal(signal.SIGKILL)
                    second = worker_process(log, **fast)

            headers = {"X-Conveyor-Timeout": "110"}  # a new worker starts meanwhile
            stream = http.stream("POST", "/v1/generate/stream", json=body, headers=headers)
            async with stream as resp:
                events = await read_sse(resp, kill_after_some)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL, log.read_text()
    *streamed, (last, final) = events
    assert last == "done", (events[-3:], log.read_text()[-2000:])
    text = "".join(data["text"] for kind, data in streamed if kind == "token")
    assert text == final["generated_text"]  # each token once, though generated twice
    ids = generator.generate_ids([body])[0]
    assert final["generated_text"] == generator.tokenizer.decode(ids, skip_special_tokens=True)


async def test_a_long_generation_keeps_its_entry_from_another_worker(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Entries idle 0.1 s are reclaimed: a 400-token generation takes longer. Its worker
    # touches its entry while it runs, so the other worker never takes it over.
    fast: dict[str, Any] = {"min_idle_ms": 100, "reclaim_interval_ms": 20, "device": "cpu"}
    first, other = harness.worker(GENERATE, **fast), harness.worker(GENERATE, **fast)
    tasks = []
    for worker in (first, other):
        await worker.start()
        tasks.append(harness.run(worker))
    base = await harness.http_server([GENERATE])
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        body = {"text": "once", "max_new_tokens": 400}
        resp = await http.post("/v1/generate", json=body)
    assert resp.status_code == 200, resp.text
    for worker in (first, other):  # each finishes what it runs, then stops
        worker.stop()
    await asyncio.gather(*tasks)
    ran = [w for w in (first, other) if any(r.generated for r in w.history)]
    assert len(ran) == 1, [list(w.history) for w in (first, other)]
    assert [r.generated for r in ran[0].history] == [400]


async def test_redis_paused_mid_generation_the_request_is_still_answered(
    own_redis: subprocess.Popen[bytes], harness: Harness
) -> None:
    _, base = await served(harness, redis_timeout_s=0.5)
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        body = {"text": "once", "max_new_tokens": 400}
        headers = {"X-Conveyor-Timeout": "60"}
        paused = False

        def pause_once() -> None:
            nonlocal paused
            if not paused:
                paused = True
                own_redis.send_signal(signal.SIGSTOP)
                asyncio.get_running_loop().call_later(2, own_redis.send_signal, signal.SIGCONT)

        stream = http.stream("POST", "/v1/generate/stream", json=body, headers=headers)
        async with stream as resp:
            events = await read_sse(resp, pause_once)
    assert paused
    *streamed, (last, final) = events
    assert last == "done", events[-3:]
    assert "".join(data["text"] for _, data in streamed) == final["generated_text"]


async def test_a_suspect_that_ends_before_it_runs_lets_the_worker_go_on(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # A worker died running a request (its entry marked on the model); by the time another
    # takes it back, its deadline has passed: it is answered without running, and the
    # new worker must go on reading (a suspect that never ran must not hold recovery).
    stream = harness.keys.stage_stream(GENERATE.name)
    await harness.worker(GENERATE, device="cpu").parts.source.ensure_stream()
    (late,) = await harness.enqueue(GENERATE.name, [{"text": "x"}], deadline_in=0.3)
    await died_running(redis, harness.keys, stream)
    await asyncio.sleep(0.5)  # past its deadline (no event marks a deadline passing)
    worker, base = await served(harness, min_idle_ms=100, reclaim_interval_ms=20)
    await beating(redis, harness.keys, GENERATE.name, "crashed-worker")

    async def answered_late() -> bool:
        return any(late.id in r.request_ids for r in worker.history)

    await until(answered_late, 30)
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        resp = await http.post("/v1/generate", json={"text": "hi", "max_new_tokens": 3})
    assert resp.status_code == 200, resp.text


class FailsOnBoom(Generator):
    """The tiny GPT-2, whose decoding step raises while a prompt holds "boom"."""

    def continuous_decoder(self, budget: int) -> Decoder | None:
        return Booming(self, budget)


class Booming(Decoder):
    def advance(self) -> list[Generation]:
        if any("boom" in str(g.item.get("text")) for g in self.rows):
            raise RuntimeError("the device fell over")
        return super().advance()


async def test_a_failing_step_fails_its_batch_and_the_worker_serves_on(
    harness: Harness, cache_dir: Path
) -> None:
    model = FailsOnBoom(model="tiny:generate", device="cpu", cache_dir=str(cache_dir))
    worker = harness.worker(GENERATE, model)
    await worker.start()
    harness.run(worker)
    base = await harness.http_server([GENERATE])
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        boom = await http.post("/v1/generate", json={"text": "boom", "max_new_tokens": 20})
        assert boom.status_code == 500, boom.text
        assert "RuntimeError" in boom.json()["detail"]
        # A temperature that overflows the softmax samples nothing: greedy, not a crash.
        tiny = {"text": "hi", "max_new_tokens": 5, "temperature": 5e-324}
        resp = await http.post("/v1/generate", json=tiny)
        assert resp.status_code == 200, resp.text
        greedy = await http.post("/v1/generate", json={"text": "hi", "max_new_tokens": 5})
        assert resp.json() == greedy.json()


def test_joiners_count_each_other_against_the_budget(generator: Generator) -> None:
    decoder = Decoder(generator, budget=1000)
    short, long, longer = decoder.open(
        [{"text": "a", "max_new_tokens": 90}, {"text": "a", "max_new_tokens": 390}] * 1
        + [{"text": "a", "max_new_tokens": 390}]
    )
    assert not isinstance(short, BaseException)
    assert not isinstance(long, BaseException)
    assert not isinstance(longer, BaseException)
    assert decoder.fits(long, [short])  # 2 rows x ~392 positions
    assert not decoder.fits(longer, [short, long])  # 3 x ~392: past 1000, though 90+390+390 is not
