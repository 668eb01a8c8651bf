"""The batch loop: read a window's worth of entries, run the model, publish and ack.

One worker serves one stage. It reads with XREADGROUP in its stage's consumer group,
so starting another worker is all scaling out takes. A batch closes when it is full or
when ``batch_wait_ms`` has passed since its *oldest* entry arrived (the stream id
carries the arrival time); later arrivals never extend it. The model runs in a
thread, one batch at a time, while the loop assembles the next. Each batch's replies,
its XACK and its stats increments go in one MULTI/EXEC.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import orjson
import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipelines import stats
from pipelines.envelope import Request, decode_request
from pipelines.errors import BatchContractError, EnvelopeError
from pipelines.graph import Registry, single
from pipelines.keys import GROUP
from pipelines.model import Item, Model, Result, StreamingModel
from pipelines.redisio import RedisClock, connect, ensure_group, entry_ms
from pipelines.stages import Stage
from workers.publish import publish
from workers.route import Outbox, Router, client_message
from workers.settings import WorkerSettings
from workers.stream import Partials

logger = logging.getLogger(__name__)

Entry = tuple[bytes, dict[bytes, bytes]]
_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)


def consumer_name() -> str:
    """A consumer name unique to this process: host-pid-random."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def _contract(items: list[Item], results: object) -> list[Result | BaseException]:
    if not isinstance(results, (list, tuple)) or len(results) != len(items):
        got = len(results) if isinstance(results, (list, tuple)) else type(results).__name__
        raise BatchContractError(
            f"predict() got {len(items)} items and returned {got}; "
            "it must return one result per item, in order"
        )
    return list(results)


def run_isolating(model: Model, items: list[Item]) -> list[Result | BaseException]:
    """Run ``model`` on ``items``; if the batch fails, retry it split in halves.

    A failing item thus fails alone, at the cost of about log2(n) extra model calls
    for the batch it was in; the other items' results are the model's own.

    Raises nothing: an item's failure is returned in its place.
    """
    try:
        return _contract(items, model.predict(items))
    except Exception as exc:
        if len(items) == 1:
            return [exc]
        mid = len(items) // 2
        return run_isolating(model, items[:mid]) + run_isolating(model, items[mid:])


def _timed_run(
    model: Model, items: list[Item], emit: Callable[[int, str], None] | None
) -> tuple[list[Result | BaseException], float]:
    # Timed in the model thread, so time spent queued behind another batch is excluded.
    started = time.perf_counter()
    results: list[Result | BaseException] | None = None
    if emit is not None and isinstance(model, StreamingModel):
        try:
            results = _contract(items, model.predict_stream(items, emit))
        except Exception:
            # Find the failing items without streaming; what was streamed is not resent.
            results = None
    if results is None:
        results = run_isolating(model, items)
    return results, time.perf_counter() - started


@dataclass
class BatchRecord:
    """What one batch did (kept in memory for tests and introspection).

    Attributes:
        size: entries in the batch.
        oldest_ms: arrival time of its oldest entry (server ms).
        closed_at: when assembly ended (server clock, seconds).
        run_s: model time.
        outcomes: items per outcome.
        request_ids: ids of the requests, in batch order.
    """

    size: int
    oldest_ms: int
    closed_at: float
    run_s: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    request_ids: list[str] = field(default_factory=list)


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
        self.consumer = consumer_name()
        self.model = model
        self.clock = RedisClock()
        self.history: deque[BatchRecord] = deque(maxlen=10_000)
        self.items_done = 0
        self._stopping = asyncio.Event()
        self._client: aioredis.Redis | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"model-{stage.name}")
        self._fatal: BaseException | None = None
        self._model_busy = 0  # batches handed to the model thread and not yet finished
        self._last_run_s = 0.0

    def stop(self) -> None:
        """Ask the loop to finish its in-flight batches and return."""
        self._stopping.set()

    async def start(self) -> None:
        """Connect, create the group and load the model (once)."""
        if self._client is None:
            self._client = connect(self.settings, block_ms=self.settings.block_ms)
            await self.clock.calibrate(self._client)
            await ensure_group(self._client, self.stream)
            await self._client.sadd(self.keys.stages_set(), self.stage.name)
        if self.model is None:
            from workers.runners import build_model

            loop = asyncio.get_running_loop()
            self.model = await loop.run_in_executor(
                self._executor, build_model, self.stage, self.settings
            )

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
                    batch = await self._assemble(burst)
                    backoff = 0.1
                except _REDIS_DOWN as exc:
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
                if self._fatal is not None:
                    raise self._fatal
                if not batch:
                    slots.release()
                    if burst:
                        break
                    continue
                batches += 1
                task = asyncio.create_task(self._process(batch))
                tasks.add(task)
                task.add_done_callback(lambda t: self._finished(t, tasks, slots))
        finally:
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        if self._fatal is not None:
            raise self._fatal
        return batches

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
        if isinstance(exc, _REDIS_DOWN):
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
        return entries

    async def _assemble(self, burst: bool) -> list[Entry]:
        entries = await self._read(self.max_batch, None if burst else self.settings.block_ms)
        if not entries:
            return []
        close_at = entry_ms(entries[0][0]) / 1000.0 + self.wait_s
        while len(entries) < self.max_batch and not self._stopping.is_set():
            remaining_ms = int((close_at - self.clock.now()) * 1000)
            if remaining_ms < 1:
                if not self._model_busy:
                    break
                # An earlier batch holds the model, so this one could not start yet
                # anyway: it keeps taking arrivals, in short reads, until the model frees.
                remaining_ms = max(1, min(20, int(self._last_run_s * 250)))
            entries += await self._read(self.max_batch - len(entries), remaining_ms)
        return entries

    async def _process(self, entries: list[Entry]) -> None:
        assert self._client is not None
        assert self.model is not None
        now = self.clock.now()
        record = BatchRecord(size=len(entries), oldest_ms=entry_ms(entries[0][0]), closed_at=now)
        waits = [max(0.0, now - entry_ms(eid) / 1000.0) for eid, _ in entries]
        out = Outbox()
        live: list[tuple[Request, Item]] = []
        for eid, fields in entries:
            try:
                req = decode_request(fields)
            except EnvelopeError as exc:
                # Nobody to answer: acknowledged below so it cannot poison the stage.
                logger.warning("stage %s: dropping entry %r: %s", self.stage.name, eid, exc)
                record.outcomes["error"] += 1
                continue
            record.request_ids.append(req.id)
            item = self._admit(out, req, now)
            if item is not None:
                live.append((req, item))

        if live:
            loop = asyncio.get_running_loop()
            partials = Partials(self._client, [req for req, _ in live], self.settings, loop)
            self._model_busy += 1
            try:
                results, record.run_s = await loop.run_in_executor(
                    self._executor,
                    _timed_run,
                    self.model,
                    [item for _, item in live],
                    partials.emit if partials.wanted else None,
                )
            finally:
                self._model_busy -= 1
                await partials.close()  # every partial is out before the final reply
            self._last_run_s = record.run_s
            done = self.clock.now()
            for (req, _), res in zip(live, results, strict=True):
                res = _checked(res)
                if isinstance(res, BaseException):
                    logger.warning(
                        "stage %s: request %s (trace %s) failed: %s",
                        self.stage.name, req.id, req.trace_id, client_message(res),
                    )  # fmt: skip
                    self.router.fail_with(out, req, res, done)
                else:
                    self.router.succeed(out, req, res, done)
        for _, reply in out.replies:
            if reply.outcome != "ok":
                record.outcomes[reply.outcome] += 1
        record.outcomes["ok"] = len(entries) - record.outcomes["error"] - record.outcomes["expired"]

        await publish(
            self._client,
            out,
            stream=self.stream,
            entry_ids=[eid for eid, _ in entries],
            stats_key=self.keys.stage_stats(self.stage.name),
            stats=stats.batch_fields(record.outcomes, record.size, waits, record.run_s),
            reply_maxlen=self.settings.reply_maxlen,
            reply_ttl_s=self.settings.reply_ttl_s,
            job_prefix=self.keys.job_prefix,
            job_ttl_s=self.settings.job_ttl_s,
        )
        self.history.append(record)
        self.items_done += len(entries)
        logger.info(
            "stage %s batch=%d ok=%d error=%d expired=%d wait_max=%.1fms run=%.1fms",
            self.stage.name, record.size, record.outcomes["ok"], record.outcomes["error"],
            record.outcomes["expired"], max(waits) * 1000, record.run_s * 1000,
        )  # fmt: skip

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


def _checked(res: Result | BaseException) -> Result | BaseException:
    """The result, or an error in its place when it is not a JSON object."""
    if isinstance(res, BaseException):
        return res
    if not isinstance(res, dict):
        return TypeError(f"result is {type(res).__name__}, not an object")
    try:
        # Checked per item here so one bad value cannot fail the whole publish.
        orjson.dumps(res)
    except TypeError as exc:
        return TypeError(f"result is not JSON-serialisable: {exc}")
    return res
