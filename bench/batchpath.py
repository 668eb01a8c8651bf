"""``python -m bench.batchpath``: which modules of ``workers/`` one batch goes through.

Starts a redis-server of its own on a free loopback port, enqueues one request for a
stage served by the echo runner, and runs a worker in-process for exactly one batch
(``max_batches=1``, its model loaded before), with a profiler that records every Python
call made in a ``workers/`` module. It prints:

- the modules entered, in the order first entered;
- re-entries: calls into a module that is already on the call stack below its caller's
  (a stage calling back into one that called it, directly or not);
- the modules the step's own code (``Worker._process``) calls into.

The count is of files whose code ran, not of imports.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

import redis.asyncio as aioredis

import workers
from bench.workloads import stage_request
from conveyor.embedded import free_port, start_redis
from pipelines.keys import Keys
from pipelines.stages import Stage, TextIn
from runtime.redisio import enqueue
from workers.loop import Worker
from workers.models.toy import Echo
from workers.settings import WorkerSettings

ROOT = Path(workers.__file__).resolve().parent


def _module(frame: FrameType) -> str | None:
    path = Path(frame.f_code.co_filename)
    if path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT).with_suffix(""))
    return None


class Path_:
    """What the profiler saw."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.reentries: list[tuple[str, str]] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = _module(frame)
        if module is None:
            return
        if module not in self.order:
            self.order.append(module)
        stack: list[str] = []
        caller = frame.f_back
        while caller is not None:
            name = _module(caller)
            if name is not None and (not stack or stack[-1] != name):
                stack.append(name)
            caller = caller.f_back
        if stack and stack[0] != module and module in stack[1:]:
            self.reentries.append((stack[0], module))


async def _one_batch(url: str) -> Path_:
    keys = Keys("batchpath")
    stage = Stage("echo", TextIn, Echo, batch_wait_ms=0)
    settings = WorkerSettings(redis_url=url, namespace="batchpath", block_ms=50)
    worker = Worker(stage, settings, Echo())
    await worker.start()
    client = aioredis.Redis.from_url(url)
    await enqueue(client, keys, stage_request(keys, "echo", "one", time.time() + 60))
    seen = Path_()
    sys.setprofile(seen)
    try:
        await worker.run(max_batches=1, burst=True)
    finally:
        sys.setprofile(None)
        await worker.close()
        await client.aclose()
    return seen


def main() -> None:
    """Run one batch and print the modules it went through."""
    port = free_port()
    with tempfile.TemporaryDirectory() as data:
        server = start_redis(port, Path(data))  # returns once it accepts connections
        try:
            seen = asyncio.run(_one_batch(f"redis://127.0.0.1:{port}/0"))
        finally:
            server.terminate()
            server.wait()
    print(f"modules of workers/ one batch ran code in: {len(seen.order)}")
    print("  " + " -> ".join(seen.order))
    pairs = sorted(set(seen.reentries))
    print(f"re-entries (a module called back while it is below on the stack): {len(pairs)}")
    for caller, callee in pairs:
        print(f"  {caller} -> {callee}")


if __name__ == "__main__":
    main()
