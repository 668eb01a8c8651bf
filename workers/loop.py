"""The batch loop: read a window's worth of entries, run the model, publish and ack.

One worker serves one stage. It reads with XREADGROUP in its stage's consumer group,
so starting another worker is all scaling out takes. A batch closes when it is full or
when ``batch_wait_ms`` has passed since its *oldest* entry arrived (the stream id
carries the arrival time); later arrivals never extend it. The model runs in a
thread, one batch at a time, while the loop assembles the next. Each batch's replies,
its XACK and its stats increments go in one atomic script call.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import ResponseError
from redis.typing import EncodableT, FieldT

from pipelines import stats
from pipelines.envelope import Request, decode_request, sender
from pipelines.errors import EnvelopeError
from pipelines.graph import single
from pipelines.keys import GROUP
from pipelines.model import Item, Model
from pipelines.redisio import (
    REDIS_DOWN,
    RedisClock,
    connect,
    ensure_group,
    entry_ms,
    group_missing,
)
from pipelines.registry import Registry
from pipelines.stages import Stage
from pipelines.stats import COST_A, COST_B
from workers.batch import BatchRecord, checked, timed_run
from workers.partials import Partials
from workers.policy import BatchPolicy
from workers.publish import publish
from workers.recovery import Heartbeat, autoclaim, deliveries, leave_group, letter, trim
from workers.route import Outbox, Router, client_message
from workers.settings import WorkerSettings

logger = logging.getLogger(__name__)

Entry = tuple[bytes, dict[bytes, bytes]]


def consumer_name() -> str:
    """A consumer name unique to this process: host-pid-random."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Worker:
    """Serves one stage until stopped.

    Args:
        stage: the stage to serve.
        settings: the worker's settings.
        model: an already-built model (tests, embedding); built from the stage if None.
    """

    def __init__(
        self,
        stage: Stage,
        settings: WorkerSettings,
        model: Model | None = None,
        registry: Registry | None = None,
    ) -> None:
        self.stage = stage
        self.router = Router(registry or Registry([single(stage)]), settings.keys, stage.name)
        self.settings = settings
        self.keys = settings.keys
        self.stream = self.keys.stage_stream(stage.name)
        self.max_batch = settings.max_batch_size or stage.max_batch_size
        wait_ms = stage.batch_wait_ms if settings.batch_wait_ms is None else settings.batch_wait_ms
        self.wait_s = wait_ms / 1000.0
        self.consumer = settings.consumer_name or consumer_name()
        self.model = model
        self.clock = RedisClock()
        self.history: deque[BatchRecord] = deque(maxlen=10_000)
        self.items_done = 0
        self._stopping = asyncio.Event()
        self._client: aioredis.Redis | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"model-{stage.name}")
        self._fatal: BaseException | None = None
        self._model_busy = 0  # batches handed to the model thread and not yet finished
        self.policy = BatchPolicy(self.max_batch) if settings.adaptive_batching else None
        self._last_run_s = 0.0
        self._suspects: list[Entry] = []  # reclaimed entries, run one at a time
        self._next_reclaim = 0.0
        self._next_trim = 0.0
        self._started_reading = False
        self._suspect_running = False
        self._suspect_done = asyncio.Event()
        self.dead_lettered = 0

    def stop(self) -> None:
        """Ask the loop to finish its in-flight batches and return."""
        self._stopping.set()

    async def start(self) -> None:
        """Connect, create the group and load the model (once)."""
        if self._client is None:
            self._client = connect(self.settings, block_ms=self.settings.block_ms)
            await self.clock.calibrate(self._client)
            await self._ensure_stream()
        if self.model is None:
            from workers.build import build_model

            loop = asyncio.get_running_loop()
            self.model = await loop.run_in_executor(
                self._executor, build_model, self.stage, self.settings
            )

    async def _ensure_stream(self) -> None:
        assert self._client is not None
        await ensure_group(self._client, self.stream)
        await self._client.sadd(self.keys.stages_set(), self.stage.name)

    async def close(self) -> None:
        """Release the connection and the model thread."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self._executor.shutdown(wait=False)

    async def run(self, *, max_batches: int | None = None, burst: bool = False) -> int:
        """Serve until stopped; returns the number of batches run.

        Args:
            max_batches: stop after this many batches (tests, benchmarks).
            burst: stop once the stream has nothing new to deliver.
        """
        await self.start()
        assert self._client is not None
        logger.info(
            "stage %s: consumer %s reading %s (batch<=%d, wait %.1f ms)",
            self.stage.name,
            self.consumer,
            self.stream,
            self.max_batch,
            self.wait_s * 1000,
        )
        slots = asyncio.Semaphore(self.settings.max_concurrent_batches)
        tasks: set[asyncio.Task[None]] = set()
        batches = 0
        backoff = 0.1
        try:
            while not self._stopping.is_set() and (max_batches is None or batches < max_batches):
                await slots.acquire()
                try:
                    batch, suspect = await self._next_batch(burst)
                    backoff = 0.1
                except REDIS_DOWN as exc:
                    slots.release()
                    logger.warning(
                        "stage %s: redis unreachable (%s); retry in %.1fs",
                        self.stage.name,
                        exc,
                        backoff,
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                except ResponseError as exc:
                    slots.release()
                    if not group_missing(exc):
                        raise
                    # What the group held is gone with it; what comes next must not be.
                    logger.warning("stage %s: %s; re-creating the stream's group",
                                   self.stage.name, exc)  # fmt: skip
                    try:
                        await self._ensure_stream()
                    except REDIS_DOWN:  # gone again: the next read backs off
                        await asyncio.sleep(backoff)
                    continue
                if self._fatal is not None:
                    raise self._fatal
                if not batch:
                    slots.release()
                    if burst:
                        break
                    continue
                batches += 1
                task = asyncio.create_task(self._process(batch, suspect))
                tasks.add(task)
                task.add_done_callback(lambda t: self._finished(t, tasks, slots))
        finally:
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        if self._fatal is not None:
            raise self._fatal
        if self._stopping.is_set():
            await self._leave_group()
        return batches

    async def _next_batch(self, burst: bool) -> tuple[list[Entry], bool]:
        """Reclaimed suspects first, one at a time, then new entries; and whether the
        batch is a suspect."""
        assert self._client is not None
        if self._suspect_running:
            # Nothing new is taken while a suspect runs: if it kills this process, it
            # takes no other entry with it. Recovery is serial, but it is rare.
            await self._suspect_done.wait()
        now = time.monotonic()
        if now >= self._next_trim:
            self._next_trim = now + self.settings.trim_interval_s
            await trim(self._client, self.stream)
        if not self._suspects and now >= self._next_reclaim:
            self._next_reclaim = now + self.settings.reclaim_interval_ms / 1000
            if not self._started_reading:
                # A worker restarted under a stable name first takes back its own pending.
                self._started_reading = True
                mine = await self._client.xreadgroup(
                    GROUP, self.consumer, {self.stream: "0"}, count=10_000
                )
                own = [(e, f) for e, f in cast(list[Any], mine)[0][1] if f] if mine else []
                await self._screen(own)
            # One at a time: a claim counts as a delivery, so claiming a crashed batch
            # whole would charge every innocent entry for the poison's next crash.
            claimed = await autoclaim(
                self._client, self.stream, self.consumer, self.settings.min_idle_ms, 1
            )
            if claimed:
                self._next_reclaim = now  # more may be waiting: look again next time
            await self._screen(claimed)
        if self._suspects:
            # An entry delivered before may be what killed its last worker: it runs alone,
            # and nothing else is claimed meanwhile, so a crash charges no other entry a
            # delivery.
            self._suspect_running = True
            self._suspect_done.clear()
            return [self._suspects.pop(0)], True
        return await self._assemble(burst), False

    async def _screen(self, entries: list[Entry]) -> None:
        """Dead-letter entries past the delivery cap; queue the rest as suspects."""
        if not entries:
            return
        assert self._client is not None
        counts = await deliveries(self._client, self.stream, self.consumer, [e for e, _ in entries])
        cap = self.settings.max_deliveries
        over = [(eid, f) for eid, f in entries if counts.get(eid, 1) > cap]
        self._suspects += [(eid, f) for eid, f in entries if counts.get(eid, 1) <= cap]
        if over:
            await self._dead_letter(over, counts)

    async def _dead_letter(self, entries: list[Entry], counts: dict[bytes, int]) -> None:
        assert self._client is not None
        out = Outbox()
        now = self.clock.now()
        letters: list[tuple[str, dict[FieldT, EncodableT]]] = []
        for eid, fields in entries:
            message = (
                f"dead-lettered after {counts.get(eid)} deliveries (it may crash the worker); "
                f"inspect with `conveyor dlq list {self.stage.name}`"
            )
            letters.append((self.keys.dead_letters(self.stage.name),
                            letter(eid, fields, counts.get(eid, 0), message)))  # fmt: skip
            try:
                req = decode_request(fields)
            except EnvelopeError:
                who = sender(fields)
                if who is not None:
                    self.router.fail_unreadable(out, who, message)
                continue
            self.router.fail(out, req, "error", message, status=500, now=now)
            logger.error("stage %s: request %s dead-lettered: %s", self.stage.name, req.id, message)
        await publish(
            self._client, out, stream=self.stream, entry_ids=[eid for eid, _ in entries],
            stats_key=self.keys.stage_stats(self.stage.name),
            stats={"dead_letters": len(entries)}, reply_maxlen=self.settings.reply_maxlen,
            reply_ttl_s=self.settings.reply_ttl_s, token_key=self._token_key(),
            job_prefix=self.keys.job_prefix,
            job_ttl_s=self.settings.job_ttl_s, dead_letters=letters,
        )  # fmt: skip
        self.dead_lettered += len(entries)

    def _token_key(self) -> str:
        """A fresh key for one publish call (what makes its retry safe)."""
        return self.keys.publish_token(f"{self.consumer}-{secrets.token_hex(8)}")

    def _gauges(self) -> dict[str, float] | None:
        """The learned cost model, for the gateway's admission (see gateway/admission.py)."""
        if self.policy is None or not self.policy.cost.known:
            return None
        a, b = self.policy.cost.coefficients()
        return {COST_A: a, COST_B: b}

    async def _leave_group(self) -> None:
        assert self._client is not None
        try:
            await leave_group(self._client, self.stream, self.consumer)
        except REDIS_DOWN as exc:
            logger.warning("stage %s: could not leave the group: %s", self.stage.name, exc)
        except ResponseError as exc:
            if not group_missing(exc):  # no group: nothing to leave
                raise

    def _finished(
        self, task: asyncio.Task[None], tasks: set[asyncio.Task[None]], slots: asyncio.Semaphore
    ) -> None:
        tasks.discard(task)
        slots.release()
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        if isinstance(exc, REDIS_DOWN):
            # Entries stay pending in the group; they are redelivered, not lost.
            logger.warning(
                "stage %s: could not publish a batch, redis unreachable: %s", self.stage.name, exc
            )
        else:
            logger.error("stage %s: batch task failed", self.stage.name, exc_info=exc)
            self._fatal = exc
            self._stopping.set()

    async def _read(self, count: int, block_ms: int | None) -> list[Entry]:
        assert self._client is not None
        reply = await self._client.xreadgroup(
            GROUP, self.consumer, {self.stream: ">"}, count=count, block=block_ms
        )
        if not reply:
            return []
        entries: list[Entry] = cast(list[Any], reply)[0][1]
        if self.policy is not None:
            for eid, _ in entries:
                self.policy.arrivals.observe(entry_ms(eid) / 1000.0)
        return entries

    async def _assemble(self, burst: bool) -> list[Entry]:
        entries = await self._read(self.max_batch, None if burst else self.settings.block_ms)
        if not entries:
            return []
        close_at = entry_ms(entries[0][0]) / 1000.0 + self.wait_s
        while len(entries) < self.max_batch and not self._stopping.is_set():
            now = self.clock.now()
            if self.policy and not self._model_busy and self.policy.go_now(len(entries), now):
                break  # waiting longer would not pay (see workers/policy.py)
            remaining_ms = int((close_at - now) * 1000)
            if remaining_ms < 1:
                if not self._model_busy:
                    break
                # An earlier batch holds the model, so this one could not start yet
                # anyway: it keeps taking arrivals, in short reads, until the model frees.
                remaining_ms = max(1, min(20, int(self._last_run_s * 250)))
            entries += await self._read(self.max_batch - len(entries), remaining_ms)
        return entries

    async def _process(self, entries: list[Entry], suspect: bool = False) -> None:
        try:
            await self._run_batch(entries)
        finally:
            if suspect:
                self._suspect_running = False
                self._suspect_done.set()

    async def _run_batch(self, entries: list[Entry]) -> None:
        assert self._client is not None
        assert self.model is not None
        now = self.clock.now()
        record = BatchRecord(size=len(entries), oldest_ms=entry_ms(entries[0][0]), closed_at=now)
        waits = [max(0.0, now - entry_ms(eid) / 1000.0) for eid, _ in entries]
        out = Outbox()
        live: list[tuple[Request, Item]] = []
        letters: list[tuple[str, dict[FieldT, EncodableT]]] = []
        dropped: list[str] = []
        seen: set[str] = set()
        for eid, fields in entries:
            try:
                req = decode_request(fields)
            except EnvelopeError as exc:
                # The gateway sends nothing a worker cannot decode (envelope.wire_problem):
                # this entry is foreign, corrupted or from another version. Acknowledged so
                # it cannot poison the stage, kept as a dead letter, and its caller told.
                letter_, answered = self._unreadable(out, eid, fields, exc)
                letters.append(letter_)
                if not answered:  # an answered one counts its error with its reply
                    dropped.append(self.keys.dropped(self.stage.name, eid.decode()))
                continue
            if req.enqueue_by is not None and entry_ms(eid) / 1000 > req.enqueue_by:
                # Written after its gateway gave up on the write (Redis stalled) and told
                # the client 503: running it would answer a request the client may resend.
                logger.warning("stage %s: request %s arrived after its gateway refused it; "
                               "dropped", self.stage.name, req.id)  # fmt: skip
                continue
            marker = self.keys.done(req.id, req.step)
            if marker in seen:
                # The same request twice in one batch (an enqueue retried after a lost
                # answer): one run, one answer; the copy is only acknowledged.
                continue
            seen.add(marker)
            record.request_ids.append(req.id)
            record.trace_ids.append(req.trace_id)
            item = self._admit(out, req, now)
            if item is not None:
                live.append((req, item))

        if live:
            loop = asyncio.get_running_loop()
            partials = Partials(self._client, [req for req, _ in live], self.settings, loop)
            ids = [eid for eid, _ in entries]
            beat_s = self.settings.min_idle_ms / 3000
            heartbeat = Heartbeat(self._client, self.stream, self.consumer, ids, beat_s)
            self._model_busy += 1
            try:
                results, record.run_s = await loop.run_in_executor(
                    self._executor,
                    timed_run,
                    self.model,
                    [item for _, item in live],
                    partials.emit if partials.wanted else None,
                )
            finally:
                self._model_busy -= 1
                await heartbeat.stop()
                await partials.close()  # every partial is out before the final reply
            self._last_run_s = record.run_s
            if self.policy is not None:
                self.policy.cost.observe(len(live), record.run_s)
            done = self.clock.now()
            for (req, _), res in zip(live, results, strict=True):
                if self.router.late(out, req, done):
                    continue
                res = checked(res)
                if isinstance(res, BaseException):
                    logger.warning(
                        "stage %s: request %s (trace %s) failed: %s",
                        self.stage.name, req.id, req.trace_id, client_message(res),
                    )  # fmt: skip
                    self.router.fail_with(out, req, res, done)
                else:
                    self.router.succeed(out, req, res, done)
        # Counted as publish counts them: one outcome per request (see Effects.outcome).
        record.outcomes.update(effects.outcome() for effects in out.effects.values())
        record.outcomes["error"] += len(dropped)

        await publish(
            self._client,
            out,
            stream=self.stream,
            entry_ids=[eid for eid, _ in entries],
            stats_key=self.keys.stage_stats(self.stage.name),
            stats=stats.batch_fields(record.size, len(live), waits, record.run_s)
            | ({"dead_letters": len(letters)} if letters else {}),
            reply_maxlen=self.settings.reply_maxlen,
            reply_ttl_s=self.settings.reply_ttl_s,
            token_key=self._token_key(),
            job_prefix=self.keys.job_prefix,
            job_ttl_s=self.settings.job_ttl_s,
            dead_letters=letters,
            gauges=self._gauges(),
            dropped=dropped,
        )
        self.history.append(record)
        self.items_done += len(entries)
        logger.info(
            "stage %s batch=%d ok=%d error=%d expired=%d wait_max=%.1fms run=%.1fms traces=%s",
            self.stage.name, record.size, record.outcomes["ok"], record.outcomes["error"],
            record.outcomes["expired"], max(waits) * 1000, record.run_s * 1000,
            ",".join(record.trace_ids),
        )  # fmt: skip

    def _unreadable(
        self, out: Outbox, eid: bytes, fields: dict[bytes, bytes], exc: EnvelopeError
    ) -> tuple[tuple[str, dict[FieldT, EncodableT]], bool]:
        """Answer an entry that does not decode, if it says who sent it; its dead letter,
        and whether it was answered."""
        who = sender(fields)
        message = (f"stage {self.stage.name!r} could not decode this request ({exc}); it was "
                   f"dead-lettered: `conveyor dlq list {self.stage.name}`")  # fmt: skip
        logger.error("stage %s: entry %r dead-lettered, request %s: %s", self.stage.name,
                     eid, who.id if who else "unknown", exc)  # fmt: skip
        answered = who is not None and self.router.fail_unreadable(out, who, message)
        return (self.keys.dead_letters(self.stage.name), letter(eid, fields, 1, message)), answered

    def _admit(self, out: Outbox, req: Request, now: float) -> Item | None:
        """The item to run for ``req``, or None when it ends here (expired, invalid)."""
        if req.deadline <= now:
            self.router.fail(
                out, req, "expired", "deadline passed before the step ran", status=504, now=now
            )
            return None
        try:
            pipeline, step = self.router.locate(req)
            payload = pipeline.input_of(step, req.state, None) if step.join else req.payload
            item: Item = self.stage.input_model.model_validate(payload).model_dump(mode="json")
        except ValidationError as exc:
            where = f"step {req.step!r} of {req.pipeline!r}"
            message = f"invalid input for {where}: {exc.error_count()} error(s)"
            self.router.fail(out, req, "error", message, status=422, now=now)
            return None
        except Exception as exc:  # unknown pipeline/step, or a join's input function failed
            self.router.fail_with(out, req, exc, now)
            return None
        return item
