"""One FastAPI process with an asyncio queue and a dynamic-batching loop, as a baseline.

The pattern of the Hugging Face docs ("using pipelines for a webserver"): each request
puts ``(item, future)`` on an :class:`asyncio.Queue` and awaits the future; one loop per
model takes the first waiting item, then collects more until ``max_batch`` items or
``batch_wait_ms`` after that first item (whatever is already queued is taken at once),
runs the model on the batch in a thread and resolves the futures. One batch runs at a
time; requests arriving meanwhile queue up and form the next batch.

Served by uvicorn: ``BENCH_WORKLOADS=embed uvicorn bench.hf_batching:app --port 8002``.
Environment: ``BENCH_WORKLOADS`` (comma-separated stages, default all), ``BENCH_DEVICE``,
``BENCH_MAX_BATCH`` (32), ``BENCH_BATCH_WAIT_MS`` (5). ``GET /stats`` reports items and
batches run per workload, for the mean batch size, and the real and padded tokens of those
batches (:func:`bench.workloads.count_tokens`), for the padding efficiency.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import orjson
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from bench.workloads import WORKLOADS, Tokens, count_tokens, load_model, stages_of
from pipelines.model import Item, Model, Result
from pipelines.stages import TextIn

logger = logging.getLogger(__name__)

MAX_BATCH = int(os.environ.get("BENCH_MAX_BATCH", "32"))
BATCH_WAIT_S = float(os.environ.get("BENCH_BATCH_WAIT_MS", "5")) / 1000
DEVICE = os.environ.get("BENCH_DEVICE", "auto")

Waiting = tuple[Item, "asyncio.Future[Result | BaseException]"]


@dataclass
class Batcher:
    """One model, its queue and its counters.

    Attributes:
        model: the loaded model.
        tokens: real and padded tokens of its batches (None: the model has no tokenizer).
        queue: requests waiting for a batch.
        items: items run so far.
        batches: batches run so far.
    """

    model: Model
    tokens: Tokens | None = None
    queue: asyncio.Queue[Waiting] = field(default_factory=asyncio.Queue)
    items: int = 0
    batches: int = 0

    async def run(self) -> None:
        """Form batches and run them, forever."""
        while True:
            batch = [await self.queue.get()]
            closes = time.monotonic() + BATCH_WAIT_S
            while len(batch) < MAX_BATCH:
                if not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                    continue
                left = closes - time.monotonic()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), left))
                except TimeoutError:
                    break
            await self._run_batch(batch)

    async def _run_batch(self, batch: list[Waiting]) -> None:
        try:
            results = await asyncio.to_thread(self.model.predict, [item for item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"predict returned {len(results)} results for {len(batch)}")
        except Exception as exc:
            logger.exception("batch of %d failed", len(batch))
            results = [exc] * len(batch)
        self.items += len(batch)
        self.batches += 1
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)


_batchers: dict[str, Batcher] = {}


@asynccontextmanager
async def _lifespan(_: FastAPI) -> AsyncIterator[None]:
    names = [
        n.strip()
        for n in os.environ.get("BENCH_WORKLOADS", ",".join(stages_of(list(WORKLOADS)))).split(",")
    ]
    tasks = []
    for name in filter(None, names):
        model = await asyncio.to_thread(load_model, name, DEVICE)
        _batchers[name] = Batcher(model, count_tokens(model))
        tasks.append(asyncio.create_task(_batchers[name].run(), name=f"batcher-{name}"))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


app = FastAPI(title="bench: one process, asyncio queue + dynamic batching", lifespan=_lifespan)


@app.post("/v1/{workload}")
async def infer(workload: str, body: TextIn) -> Response:
    """Queue the body for ``workload``'s batching loop and answer with its result."""
    batcher = _batchers.get(workload)
    if batcher is None:
        return JSONResponse({"detail": f"workload {workload!r} is not served"}, 404)
    future: asyncio.Future[Result | BaseException] = asyncio.get_running_loop().create_future()
    await batcher.queue.put((body.model_dump(), future))
    result = await future
    if isinstance(result, BaseException):
        return JSONResponse({"detail": f"{type(result).__name__}: {result}"}, 500)
    return Response(orjson.dumps(result), media_type="application/json")


@app.get("/stats")
async def stats() -> dict[str, dict[str, int]]:
    """Items and batches run so far, and their real and padded tokens, per workload."""
    return {
        name: {
            "items": b.items,
            "batches": b.batches,
            **(
                {"real_tokens": b.tokens.real, "padded_tokens": b.tokens.padded} if b.tokens else {}
            ),
        }
        for name, b in _batchers.items()
    }
