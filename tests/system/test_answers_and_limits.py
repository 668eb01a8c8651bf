"""Adversarial tests: each one is a break found by attacking conveyor's promises, and each
FAILS on the code it was written against. The comment on each states the break, what was
observed against what is promised, and how it was triggered. Every test is bounded in time.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError

from gateway.settings import GatewaySettings
from pipelines.envelope import decode_replies
from pipelines.errors import ConfigError
from pipelines.graph import Pipeline, function
from pipelines.model import Item, Result
from pipelines.settings import MAX_DEADLINE_S
from pipelines.stages import GenerateIn, Stage
from runtime.status import stage_status
from tests.helpers import (
    REPO,
    Doubler,
    Harness,
    NumberIn,
    conveyor,
    died_running,
    number_stage,
    replies_in,
    until,
)
from tests.support.faultapp import SLOW, spawn
from workers.models.hf_text import Generator

# --------------------------------------------------------------------------------------
# 1. A job whose result holds a numpy float kills the worker (and every request after it).
# --------------------------------------------------------------------------------------


class NumpyDoubler:
    """A model that returns numpy floats, as models computing with numpy commonly do.

    ``np.float64`` is a subclass of ``float``: ``wire_problem`` accepts it (finite float),
    and the sync path answers 200 (pydantic converts it when the Reply is dumped).
    """

    def predict(self, items: list[Item]) -> list[Result]:
        return [{"value": np.float64(item["value"]) * 2} for item in items]


async def test_job_with_numpy_float_result_completes_and_worker_survives(
    harness: Harness,
) -> None:
    # BREAK: "what the gateway accepts the workers can run" / "an accepted request
    # completes". The same model output the sync route answers (200 {"value": 4.0})
    # crashes the worker when the request is a job: pipelines/records.py job_finished() does
    # orjson.dumps(reply.result) on the raw result, and orjson refuses numpy.float64
    # ("Type is not JSON serializable"), although workers/contract.py checked() let it
    # through (wire_problem: isinstance(x, float)). The TypeError escapes Worker._process, the
    # batch task's exception is not REDIS_DOWN, so Worker._batch_ended sets _fatal and the
    # worker stops.
    # Observed: job stays "queued" forever, the worker task dies with TypeError, and a
    # later sync request to the stage gets 504. Expected: the job is "done" with the same
    # result as the sync call (or, at worst, that one item fails alone), the worker lives.
    # Trigger: a model returning {"value": np.float64(...)}; POST /v1/jobs/double.
    stage = number_stage(batch_wait_ms=0)
    worker = harness.worker(stage, NumpyDoubler())
    await worker.start()
    task = harness.run(worker)
    http = await harness.gateway([stage])
    sync = await http.post("/v1/double", json={"value": 2})
    assert sync.status_code == 200  # holds today
    assert sync.json() == {"value": 4.0}
    job = (await http.post("/v1/jobs/double", json={"value": 3})).json()
    view: dict[str, Any] = {}
    for _ in range(50):
        await asyncio.sleep(0.1)
        view = (await http.get(f"/v1/jobs/{job['id']}")).json()
        if view["status"] != "queued":
            break
    assert not task.done(), f"the worker died: {task.exception()!r}"
    assert view["status"] == "done", view
    assert view["result"] == {"value": 6.0}
    after = await http.post("/v1/double", json={"value": 5}, headers={"X-Conveyor-Timeout": "3"})
    assert after.status_code == 200, after.text


# --------------------------------------------------------------------------------------
# CLI: odd input gives a traceback instead of a clear error.
# --------------------------------------------------------------------------------------


def test_dlq_with_a_malformed_id_is_a_clear_error_not_a_traceback(
    redis_url: str, namespace: str
) -> None:
    # BREAK: `conveyor dlq list|replay|purge STAGE --id ID` with an ID that is not a
    # stream id ("garbage", "1-x") dies with a Python traceback and exit status 1:
    # conveyor/dlq.py passes the id straight to XRANGE, Redis answers
    # "ERR Invalid stream ID", and main() only catches ConveyorError and connection
    # errors, not redis.exceptions.ResponseError.
    # Expected: like every other bad CLI input (`conveyor graph nope`, `worker nosuch`):
    # exit 2 with one "conveyor: ..." line naming the bad id, no traceback.
    # Trigger: conveyor dlq list double --id garbage
    env = {"CONVEYOR_REDIS_URL": redis_url, "CONVEYOR_NAMESPACE": namespace}
    for action in ("list", "replay", "purge"):
        done = conveyor("dlq", action, "double", "--id", "garbage", **env)
        assert "Traceback" not in done.stderr, done.stderr[-600:]
        assert done.returncode == 2, (done.returncode, done.stderr[-300:])
        assert done.stderr.startswith("conveyor: "), done.stderr[-300:]


def test_up_refuses_an_impossible_port_before_starting_anything(cache_dir: Path) -> None:
    # BREAK: `conveyor up --port 99999999` (or any port outside 0-65535) is not
    # validated: conveyor/cli.py checks --replicas (parser.error) but takes --port as any
    # int. up starts an embedded redis-server and the worker processes, prints "gateway
    # on http://127.0.0.1:99999999 ... Ctrl-C stops", and only then the gateway dies on its
    # settings (CONVEYOR_PORT le=65535) and up exits 1.
    # Expected: argument validation like --replicas: exit 2 with a usage error naming
    # --port, and nothing started. Trigger: conveyor up --port 99999999 --pipelines echo
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env |= {"CONVEYOR_CACHE_DIR": str(cache_dir)}
    full = env | {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    code = "import sys; from conveyor.cli import main; main(sys.argv[1:])"
    argv = [sys.executable, "-c", code, "up", "--port", "99999999", "--pipelines", "echo"]
    done = subprocess.run(argv, cwd=REPO, env=full, capture_output=True, text=True, timeout=90)
    assert "gateway on http://" not in done.stdout, done.stdout
    assert "embedded redis" not in done.stdout, done.stdout
    assert done.returncode == 2, (done.returncode, done.stdout[-300:], done.stderr[-300:])
    assert "--port" in done.stderr


# --------------------------------------------------------------------------------------
# Errors table: the README's 400 for an undecodable body is never answered.
# --------------------------------------------------------------------------------------


async def test_a_job_reported_expired_stays_expired(harness: Harness) -> None:
    # BREAK: exactly-once / "counters equal answers". gateway/service.py Gateway.job()
    # reports a queued job whose deadline has passed as "expired" with http_status 504,
    # but the worker only checks the deadline *before* running an item (workers/loop.py
    # _admit); a batch that started in time finishes late and publishes "done" into the
    # same record (pipelines/records.py job_finished), counted items:ok.
    # Observed: the poller sees queued -> expired (504) -> done {"value": 2}; a client
    # that stopped at "expired" was told 504 for a job that succeeded, and the stage
    # counts it ok. Expected: a job shown in a final state keeps it (either the gateway
    # does not call a running job expired, or the late result is not stored/counted).
    # Trigger: POST /v1/jobs/double with X-Conveyor-Timeout: 1 to a model taking 2 s;
    # poll GET /v1/jobs/{id} every 100 ms for 4 s.
    stage = number_stage(batch_wait_ms=0)
    worker = harness.worker(stage, Doubler(delay_s=2.0))
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([stage])
    headers = {"X-Conveyor-Timeout": "1"}
    job = (await http.post("/v1/jobs/double", json={"value": 1}, headers=headers)).json()
    seen: list[str] = []
    for _ in range(40):
        await asyncio.sleep(0.1)
        status = (await http.get(f"/v1/jobs/{job['id']}")).json()["status"]
        if not seen or seen[-1] != status:
            seen.append(status)
    final = [s for s in seen if s != "queued"]
    assert len(final) <= 1, f"a final status changed: {seen}"


# --------------------------------------------------------------------------------------
# Edge: request headers are unbounded (the 1 MiB body limit is bypassed through them).
# --------------------------------------------------------------------------------------


async def test_huge_request_headers_are_refused(harness: Harness) -> None:
    # BREAK: the edge bounds the body (413 over CONVEYOR_MAX_BODY_BYTES, "refused before
    # it is read") and the time headers may take (408), but not their size. uvicorn's
    # httptools protocol (gateway/protocol.py header_deadline_protocol subclasses
    # HttpToolsProtocol) buffers any amount of header bytes; nothing in EdgeMiddleware
    # looks at them. One request with a 30 MB header was answered 200 and grew the
    # gateway's RSS by ~136 MB; 200,000 separate headers were accepted too.
    # Expected: 431 (Request Header Fields Too Large) or another 4xx well before a header
    # block reaches the body limit. Observed: 200 OK.
    # Trigger: a raw POST /v1/double with "x-pad: " + 8 MB of "a" and a valid body.
    stage = number_stage(batch_wait_ms=0)
    worker = harness.worker(stage, Doubler())
    await worker.start()
    harness.run(worker)
    base = await harness.http_server([stage], max_body_bytes=1_048_576)
    host, port = base.removeprefix("http://").split(":")
    body = b'{"value": 1}'

    head = b"POST /v1/double HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-pad: "
    pad = b"a" * 8_000_000
    tail = b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body

    def send() -> tuple[int, bytes]:
        """How much of the request went out before the gateway closed, and its answer."""
        sent = 0
        with socket.create_connection((host, int(port)), timeout=30) as s:
            try:
                for chunk in (head, *(pad[i : i + 65536] for i in range(0, len(pad), 65536))):
                    s.sendall(chunk)
                    sent += len(chunk)
                s.sendall(tail)
                sent += len(tail)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused mid-send: the rest was never read
            try:
                return sent, s.recv(65536)
            except ConnectionResetError:
                return sent, b""

    sent, answer = await asyncio.to_thread(send)
    # Refused (431) once the header block passed its bound, long before its 8 MB were in.
    assert sent < len(head) + len(pad), f"all {sent} bytes were taken"
    if answer:
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]


# --------------------------------------------------------------------------------------
# Streaming: token events do not add up to the final text with a byte-level tokenizer.
# --------------------------------------------------------------------------------------


def _byte_level_tokenizer() -> Any:
    """A GPT-2-style byte-level BPE tokenizer (what the ``hub`` profile's gpt2 and most
    causal LMs use), trained here offline on one sentence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(["hello world"], trainer)

    class Wrapped:  # the two calls Generator makes: decode(ids, skip_special_tokens=True)
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return str(tok.decode(ids, skip_special_tokens=skip_special_tokens))

        def encode(self, text: str) -> list[int]:
            return list(tok.encode(text).ids)

    return Wrapped()


class ScriptedGenerator(Generator):
    """The real ``Generator.predict_stream`` (decode the whole row at each step, emit it),
    over a fixed continuation instead of a random model."""

    def __init__(self, continuation: str) -> None:  # no model to load
        self.tokenizer = _byte_level_tokenizer()
        self.ids = self.tokenizer.encode(continuation)

    def generate_ids(self, items: list[Item], on_tokens: Any = None) -> list[list[int]]:
        for k in range(1, len(self.ids) + 1):
            for i in range(len(items)):
                if on_tokens is not None:
                    on_tokens(i, self.ids[:k])
        return [list(self.ids) for _ in items]


async def test_streamed_tokens_add_up_to_the_final_text(harness: Harness) -> None:
    # BREAK: POST /v1/generate/stream promises `token` events {"text": new_text} as the
    # model produces them, then `done` with the result; their concatenation should be the
    # result (tests/gateway/test_streaming_jobs.py asserts it for the tiny WordPiece model).
    # Generator.predict_stream emits the whole row decoded at each step and
    # workers/partials.py Partials sends text[sent:], assuming each decode extends the last.
    # With a byte-level BPE tokenizer (gpt2 in the `hub` profile, most LLMs) a character
    # split across tokens decodes as U+FFFD first and as itself one step later: the
    # string does not grow, so the real character is never sent.
    # Observed: tokens "hi \ufffd\ufffd" against done "hi 日本". Expected: equal.
    # Trigger: a streaming stage whose Generator continues "hi 日本" (CJK/emoji text).
    stage = Stage("gen", GenerateIn, runner="unused", streaming=True)
    worker = harness.worker(stage, ScriptedGenerator("hi 日本"))
    await worker.start()
    harness.run(worker)
    base = await harness.http_server([stage])
    events: list[tuple[str, Any]] = []
    async with (
        httpx.AsyncClient(base_url=base, timeout=30) as http,
        http.stream("POST", "/v1/gen/stream", json={"text": "x"}) as resp,
    ):
        kind = ""
        async for line in resp.aiter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((kind, orjson.loads(line.removeprefix("data: "))))
    *tokens, (last, final) = events
    assert last == "done", events
    assert final == {"generated_text": "hi 日本"}
    streamed = "".join(t["text"] for _, t in tokens)
    assert streamed == final["generated_text"], f"streamed {streamed!r}"


# --------------------------------------------------------------------------------------
# Exactly once: a step that ran twice publishes twice once its "done" marker has expired.
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(115)
async def test_a_stalled_worker_resumed_after_the_marker_expired_doubles_nothing(
    harness: Harness, redis: aioredis.Redis, tmp_path: Path
) -> None:
    # BREAK: README, Reliability: "a step runs twice (a slow worker and the one that
    # reclaimed it): every step's effects and its outcome count are guarded by a 'done'
    # marker ... the second run publishes and counts nothing". The marker lives only
    # max(1, deadline - now) + 60 s (workers/route.py Router._ttl, JOIN_GRACE_S), but a
    # stalled worker (SIGSTOP, VM pause, a model call holding the GIL so the heartbeat
    # cannot run) publishes whenever it resumes, with no deadline check after predict()
    # (workers/loop.py Worker._process). Once the marker has expired, the publish script finds
    # no marker and runs the group again.
    # Observed: two "ok" replies for one request and items:ok == 2 (counters != answers).
    # Expected: one reply, items:ok == 1 (the resumed run's results are stale: its
    # deadline has long passed).
    # Trigger: one request (2 s deadline); a worker process takes it and is SIGSTOPped in
    # predict; a second worker reclaims and answers it; wait until the done marker
    # expires (~61 s); SIGCONT the first worker.
    stalled = spawn(
        "workers",
        "slow",
        log=tmp_path / "w.log",
        CONVEYOR_TEST_DELAY_S="1.5",
        CONVEYOR_BLOCK_MS="100",
    )

    async def reading() -> bool:  # started (a loaded machine takes seconds): then 2 s is 2 s
        log = tmp_path / "w.log"
        return log.exists() and "reading" in log.read_text(errors="replace")

    await until(reading, 60)
    (sent,) = await harness.enqueue("slow", [{"value": 21}], deadline_in=2)
    replies = harness.keys.reply_stream("test")
    marker = harness.keys.done(sent.id, "slow")
    try:

        async def holding() -> bool:
            status = await stage_status(redis, harness.keys, "slow")
            return status.pending == 1

        await until(holding, 60)
        stalled.send_signal(signal.SIGSTOP)  # mid-predict; its heartbeat stops too
        survivor = harness.worker(SLOW, Doubler(), min_idle_ms=300, reclaim_interval_ms=50)
        harness.run(survivor)

        async def answered() -> bool:
            return bool(await replies_in(redis, replies) >= 1)

        await until(answered, 20)
        assert await redis.exists(marker), (await redis.xrange(replies), await redis.keys("*"))

        async def marker_gone() -> bool:
            return not await redis.exists(marker)

        await until(marker_gone, 75)
        stalled.send_signal(signal.SIGCONT)
        for _ in range(100):  # up to 10 s for the resumed worker to finish its batch
            stats = await harness.stats("slow")
            if stats.get("batches", 0) >= 2:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)
    finally:
        stalled.send_signal(signal.SIGCONT)
        stalled.terminate()
        try:
            stalled.wait(timeout=15)
        except subprocess.TimeoutExpired:
            stalled.kill()
            stalled.wait()
    got = [one for _, f in await redis.xrange(replies) or [] for one in decode_replies(f or {})]
    assert [r.id for r in got] == [sent.id], f"{len(got)} replies for one request"
    items = {k: v for k, v in (await harness.stats("slow")).items() if k.startswith("items:")}
    # One outcome, counted once: ok, or expired when a busy machine had the survivor reach
    # it past its 2 s deadline (both are one answer; what must not happen is a second).
    assert items in ({"items:ok": 1}, {"items:expired": 1}), items


# --------------------------------------------------------------------------------------
# 503 "nothing is enqueued" is not true when Redis stalls: the refused job runs anyway.
# --------------------------------------------------------------------------------------


async def test_a_job_refused_with_503_during_a_redis_stall_is_not_enqueued(
    own_redis: Any, harness: Harness, redis: aioredis.Redis
) -> None:
    # BREAK: README errors table: "503 + Retry-After | ... Redis is unreachable ...;
    # nothing is enqueued", and the Python client retries every 503 after its
    # Retry-After. When Redis stalls (here: SIGSTOP for 1 s; in life a fork, an fsync
    # stall under appendfsync always, a slow command, a network hiccup) longer than
    # CONVEYOR_REDIS_TIMEOUT_S, gateway/service.py enqueue() times out on the MULTI
    # (HSET job record + XADD) it already sent, and answers 503 via refusal(). Redis then
    # wakes, reads the transaction from its socket and runs it: the job exists and its
    # request is on the stage stream, to be run. A client that follows the 503 and
    # retries gets the work done twice (two job records, two runs, counted twice).
    # Observed: 503, yet one more job record and one more stream entry after the stall.
    # Expected: a 503 leaves nothing behind (or the gateway does not say 503 for a write
    # whose outcome it does not know: e.g. an idempotency key / id the retry reuses).
    # Trigger: gateway with CONVEYOR_REDIS_TIMEOUT_S=0.5 (admission view warm); SIGSTOP
    # redis-server; POST /v1/jobs/double; SIGCONT after 1 s.
    # Fixed: the envelope carries enqueue_by (when the gateway gives up on the write); a
    # worker drops an entry whose stream id says it arrived later, and the gateway deletes
    # the record it may have left. So the refused job may reach the stream, but never
    # runs to an effect, and leaves no record.
    stage = number_stage(batch_wait_ms=0)
    http = await harness.gateway([stage], redis_timeout_s=0.5, admission_refresh_ms=600_000)
    warm = await http.post("/v1/jobs/double", json={"value": 0})
    assert warm.status_code == 202
    own_redis.send_signal(signal.SIGSTOP)
    try:
        refused = await http.post("/v1/jobs/double", json={"value": 1})
    finally:
        own_redis.send_signal(signal.SIGCONT)
    assert refused.status_code == 503, refused.text
    worker = harness.worker(stage, Doubler())
    await worker.start()
    harness.run(worker)

    async def settled() -> bool:
        status = await stage_status(redis, harness.keys, "double")
        jobs = [k async for k in redis.scan_iter(match=harness.keys.job("*"))]
        done = (await http.get(warm.headers["location"])).json()["status"] == "done"
        return done and status.lag == 0 and status.pending == 0 and len(jobs) == 1

    await until(settled, 30)  # one record: the accepted job's
    stats = await harness.stats("double")
    assert stats.get("items:ok") == 1, stats  # the refused request took no effect


# --------------------------------------------------------------------------------------
# Settings: "A bad value fails at start-up naming the setting" -- infinite timeouts pass.
# --------------------------------------------------------------------------------------


async def test_an_infinite_default_timeout_fails_at_start_up(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # BREAK: README, Configuration: "A bad value fails at start-up naming the setting."
    # CONVEYOR_DEFAULT_TIMEOUT_S=inf (or CONVEYOR_JOB_TIMEOUT_S=inf; someone asking for
    # "no timeout") passes GatewaySettings (Field(gt=0) admits infinity) and the gateway
    # starts; then every request without X-Conveyor-Timeout gets deadline = now + inf,
    # which the envelope encodes as null (pydantic's JSON mode writes inf as null), so
    # the worker cannot decode it: each request is dead-lettered and answered 500
    # "could not decode this request". (With inf jobs: every job "failed" the same way.)
    # Expected: GatewaySettings() refuses inf naming default_timeout_s (or the gateway
    # serves with no deadline). Observed: starts; POST /v1/double {"value": 1} -> 500.
    monkeypatch.setenv("CONVEYOR_DEFAULT_TIMEOUT_S", "inf")
    try:
        settings = GatewaySettings()
    except ValueError as exc:  # what the README promises
        refused = str(exc)
        assert "default_timeout_s" in refused
        return
    stage = number_stage(batch_wait_ms=0)
    worker = harness.worker(stage, Doubler())
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([stage], default_timeout_s=settings.default_timeout_s)
    resp = await http.post("/v1/double", json={"value": 1}, timeout=10)
    assert resp.status_code == 200, resp.text


async def test_a_huge_client_timeout_does_not_kill_the_worker(harness: Harness) -> None:
    # BREAK: CONVEYOR_MAX_TIMEOUT_S=inf is accepted (gt=0 only), meaning "no cap". A
    # client then sends X-Conveyor-Timeout: 1e300 (a finite number > 0, as the README
    # asks). The deadline is now + 1e300; the worker runs the item and its publish script
    # sets the done marker with "SET marker 1 EX <int(deadline - now) + 60>" (workers/
    # route.py Router._ttl): Redis refuses the 301-digit EX ("value is not an integer or
    # out of range"), the ResponseError escapes Worker._process, Worker._batch_ended sets _fatal
    # and the worker exits. The entry stays pending and kills each worker that reclaims
    # it until it is dead-lettered: one remote request takes the stage down.
    # Expected: the deadline (or the marker's TTL) is clamped; the worker answers and
    # lives. Observed: the worker task dies with ResponseError; the client never hears.
    with pytest.raises(ValidationError, match="max_timeout_s"):
        GatewaySettings(max_timeout_s=float("inf"))  # "no cap" is refused at start
    stage = number_stage(batch_wait_ms=0)
    worker = harness.worker(stage, Doubler())
    await worker.start()
    task = harness.run(worker)
    http = await harness.gateway([stage], max_timeout_s=MAX_DEADLINE_S)  # the most allowed
    call = http.post("/v1/double", json={"value": 1}, headers={"X-Conveyor-Timeout": "1e300"})
    try:
        resp = await asyncio.wait_for(call, 5)
    except TimeoutError:
        resp = None
    assert not task.done(), f"the worker died: {task.exception()!r}"
    assert resp is not None
    assert resp.status_code == 200, resp.text


# --------------------------------------------------------------------------------------
# CLI: one undecodable dead letter blocks `conveyor dlq replay` for every good one.
# --------------------------------------------------------------------------------------


async def test_dlq_replay_skips_an_undecodable_letter_and_replays_the_rest(
    harness: Harness, redis: aioredis.Redis, redis_url: str, namespace: str
) -> None:
    # BREAK: workers dead-letter entries they cannot decode (README: "acknowledged,
    # dead-lettered with its reason"), into the same {ns}:dlq:<stage> as poison requests.
    # `conveyor dlq replay STAGE` (conveyor/dlq.py) calls decode_request on
    # each letter in order; the first undecodable one raises EnvelopeError (a
    # ConveyorError), main() prints "conveyor: invalid request envelope: 1 error(s)"
    # (not naming the entry) and exits 2: every good letter after it stays dead.
    # Expected: undecodable letters are skipped (reported by id), the rest replayed.
    # Observed: exit 2, nothing replayed. Trigger: a foreign entry {"e": "not json"} on
    # the stage stream (dead-lettered), then a request dead-lettered after max
    # deliveries; `conveyor dlq replay double`.
    stage = number_stage(batch_wait_ms=0)
    stream = harness.keys.stage_stream("double")
    dlq = harness.keys.dead_letters("double")
    worker = harness.worker(
        stage, Doubler(), max_deliveries=1, min_idle_ms=10, reclaim_interval_ms=10
    )
    await worker.start()
    await redis.xadd(stream, {"e": b"not json"})
    await worker.run(max_batches=1, burst=True)
    await harness.enqueue("double", [{"value": 1}])
    await died_running(redis, harness.keys, stream)  # a worker that died running it
    for _ in range(100):
        await worker.run(max_batches=1, burst=True)
        if await redis.xlen(dlq) >= 2:
            break
        await asyncio.sleep(0.05)
    assert await redis.xlen(dlq) == 2
    before = await redis.xlen(stream)
    env = {"CONVEYOR_REDIS_URL": redis_url, "CONVEYOR_NAMESPACE": namespace}
    # The burst worker has left: no worker serves the stage, so --force.
    done = await asyncio.to_thread(conveyor, "dlq", "replay", "double", "--force", **env)
    assert await redis.xlen(stream) == before + 1, (done.returncode, done.stderr[-300:])
    assert "replayed 1" in done.stdout, (done.stdout, done.stderr[-300:])
    assert done.returncode == 0, done.stderr[-300:]
    assert "skipped 1 undecodable dead letter(s)" in done.stderr, done.stderr[-300:]
    listing = await asyncio.to_thread(conveyor, "dlq", "list", "double", **env)
    assert listing.returncode == 0, listing.stderr[-300:]
    assert "undecodable entry" in listing.stdout, listing.stdout
    assert "1 dead letter(s)" in listing.stdout, listing.stdout


# --------------------------------------------------------------------------------------
# Pipelines: a fan-out without a join is accepted, and answers each request twice.
# --------------------------------------------------------------------------------------


def _first(payload: dict[str, Any]) -> dict[str, Any]:
    return {"b": 1}


def _second(payload: dict[str, Any]) -> dict[str, Any]:
    return {"c": 2}


def test_a_fan_out_without_a_join_is_refused_when_built() -> None:
    # BREAK: README: "The graph is checked when built: unknown steps, cycles, unreachable
    # steps and joins not fed by exactly their branches fail with the step's name", and
    # fan-out is described as going "into a join step". pipelines/graph.py
    # Pipeline._validate checks joins only; then=("b", "c") with two terminal steps is
    # accepted. Each request then gets two final answers (workers/route.py: each
    # terminal step replies): the sync caller gets whichever lands first, a job record is
    # overwritten by the second, and both count items:ok -- two answers for one request.
    # Expected: ConfigError at construction naming the fan-out (or exactly one answer).
    # Observed: built; POST /v1/fan -> {"c": 2} or {"b": 1}; 2 replies; b and c each ok.
    # Trigger: Pipeline("fan", NumberIn, (function("a", f, then=("b", "c")),
    # function("b", ...), function("c", ...))).
    # Refused when built (the running half of this test, which counted the answers
    # after a sleep, is gone with the break: nothing of this graph can run).
    with pytest.raises(ConfigError, match="step 'a' fans out to \\['b', 'c'\\]"):
        Pipeline(
            "fan",
            NumberIn,
            (
                function("a", lambda p: p, then=("b", "c")),
                function("b", _first),
                function("c", _second),
            ),
        )


async def test_an_async_client_sending_a_body_too_large_reads_its_413(harness: Harness) -> None:
    # BREAK (outside run five): conveyor.AsyncClient (async httpx) posting 8 MB got
    # httpx.ReadError, not the 413, five times of five: the gateway answered and closed
    # with the body unread, and a socket closed with bytes unread is reset, losing the
    # answer before a client still sending read it. Expected: the 413 naming the bound.
    stage = number_stage(batch_wait_ms=0)
    base = await harness.http_server([stage], max_body_bytes=1_048_576)
    body = {"value": 1, "pad": "a" * 8_000_000}
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        for _ in range(3):
            resp = await http.post("/v1/double", json=body)
            assert resp.status_code == 413, resp.text
            assert "1048576 bytes" in resp.json()["detail"]
