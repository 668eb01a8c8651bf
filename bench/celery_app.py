"""FastAPI + Celery + Redis, one task per request: the common pattern, as a baseline.

The FastAPI endpoint validates the body, sends one Celery task per request
(``run_one.delay(workload, item)``) and waits for its result with ``AsyncResult.get``
in a thread, so the event loop stays free. Redis is both broker and result backend;
Celery's Redis result backend is kept per thread (each waiting thread has its own
pub/sub connection), so the send and the wait happen in the same thread of a pool
large enough for every client in flight. The task runs the workload's model on one
item, the way a task queue without batching does.

Run by the benchmark (``bench/systems.py``) as two processes::

    BENCH_REDIS_URL=redis://127.0.0.1:PORT/0 celery -A bench.celery_app:celery \\
        worker --pool=solo --queues=bench
    BENCH_REDIS_URL=redis://127.0.0.1:PORT/0 uvicorn bench.celery_app:api --port 8001

Environment: ``BENCH_REDIS_URL`` (broker and backend), ``BENCH_DEVICE`` (``auto``,
``cpu``, ``cuda``), ``BENCH_WAITERS`` (threads waiting on results, default 512).
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

import orjson
from celery import Celery  # type: ignore[import-untyped, import-not-found, unused-ignore]
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from bench.workloads import WORKLOADS, load_model
from pipelines.model import Item, Model, Result
from pipelines.stages import TextIn

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
DEVICE = os.environ.get("BENCH_DEVICE", "auto")
TIMEOUT_S = 30.0
QUEUE = "bench"

celery: Any = Celery("bench", broker=REDIS_URL, backend=REDIS_URL)
celery.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@cache
def _model(workload: str) -> Model:
    """The workload's model, loaded once per worker process on first use."""
    return load_model(workload, DEVICE)


def _run_one(workload: str, item: Item) -> Result:
    """The task: the model on a batch of one."""
    result = _model(workload).predict([item])[0]
    if isinstance(result, BaseException):
        raise result
    return result


run_one: Any = celery.task(name="bench.run_one")(_run_one)

api = FastAPI(title="bench: FastAPI + Celery, one task per request")
_waiters = ThreadPoolExecutor(
    int(os.environ.get("BENCH_WAITERS", "512")), thread_name_prefix="celery-wait"
)


def _send_and_wait(workload: str, item: Item) -> Result:
    result: Result = run_one.delay(workload, item).get(timeout=TIMEOUT_S)
    return result


@api.post("/v1/{workload}")
async def infer(workload: str, body: TextIn) -> Response:
    """Run ``workload``'s model on the body through one Celery task."""
    if workload not in WORKLOADS:
        return JSONResponse({"detail": f"unknown workload {workload!r}"}, 404)
    loop = asyncio.get_running_loop()
    try:
        result = await loop.run_in_executor(_waiters, _send_and_wait, workload, body.model_dump())
    except Exception as exc:  # celery's TimeoutError, or the task's own error
        status = 504 if type(exc).__name__ == "TimeoutError" else 500
        return JSONResponse({"detail": f"{type(exc).__name__}: {exc}"}, status)
    return Response(orjson.dumps(result), media_type="application/json")
