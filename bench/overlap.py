"""The host overlapped with the device, on the simulated accelerator (issue 24, item 3).

``python -m bench.overlap`` runs one worker (in this process, on a real redis-server) over
a backlog of full batches on :class:`~workers.models.simulated.SimulatedAccelerator`: each
batch holds the GIL ``prepare`` ms on the host (as tokenizing does) and takes ``device``
ms on its device (a sleep: the GIL is free, as a GPU's wait is). It runs the model staged
(prepared in a host thread beside the device's run, finished after its turn) and, for the
contrast, as one ``predict`` call per batch, and prints a Markdown table: batches/s, and
that rate against ``1 / max(prepare, device)`` (the overlap's ceiling) and against
``1 / (prepare + device)`` (no overlap). The event loop's own work (decode, validate,
encode, publish) holds the GIL too: it shares the host's side of the ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

from bench.workloads import stage_request
from conveyor.embedded import free_port, start_redis
from pipelines.stages import Stage, TextIn
from runtime.redisio import enqueue
from workers.loop import Worker
from workers.models.simulated import OneCall, SimulatedAccelerator
from workers.settings import WorkerSettings

HOST = "127.0.0.1"


async def served(url: str, staged: bool, prepare_s: float, device_s: float, batches: int) -> float:
    """Batches per second the worker ran over a backlog of ``batches`` full batches."""
    batch = 32
    sim = SimulatedAccelerator(prepare_s=prepare_s, device_s=device_s, first_call_s=0.0)
    settings = WorkerSettings(redis_url=url, block_ms=100, namespace=f"overlap{int(staged)}")
    keys = settings.keys
    stage = Stage("sim", TextIn, "bench", max_batch_size=batch, batch_wait_ms=5)
    client = aioredis.from_url(url)
    pipe = client.pipeline(transaction=False)
    deadline = time.time() + 600
    for i in range(batches * batch):
        enqueue(pipe, keys, stage_request(keys, "sim", f"a short text {i}", deadline, f"r{i}"))
    await pipe.execute()
    worker = Worker(stage, settings, sim if staged else OneCall(sim))
    await worker.start()
    started = time.perf_counter()
    ran = await worker.run(burst=True)
    took = time.perf_counter() - started
    await worker.close()
    await client.aclose()
    return ran / took


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        redis = start_redis(port, Path(tmp))
        try:
            url = f"redis://{HOST}:{port}/0"
            print("| prepare ms | device ms | model | batches/s | / 1÷max | / 1÷sum |")
            print("|---|---|---|---|---|---|")
            for prepare_ms, device_ms in args.pairs:
                ceiling = 1000 / max(prepare_ms, device_ms)
                serial = 1000 / (prepare_ms + device_ms)
                for staged in (True, False):
                    times = (prepare_ms / 1000, device_ms / 1000)
                    rate = await served(url, staged, *times, args.batches)
                    print(
                        f"| {prepare_ms:g} | {device_ms:g} | {'staged' if staged else 'one call'}"
                        f" | {rate:.1f} | {rate / ceiling:.2f} | {rate / serial:.2f} |"
                    )
        finally:
            redis.terminate()
            redis.wait(10)


def pair(text: str) -> tuple[float, float]:
    prepare, _, device = text.partition(",")
    return float(prepare), float(device)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pairs",
        type=pair,
        nargs="+",
        default=[(10.0, 20.0), (20.0, 20.0), (20.0, 10.0)],
        help="prepare,device milliseconds per batch (several)",
    )
    parser.add_argument("--batches", type=int, default=60, help="full batches of 32 per run")
    asyncio.run(main(parser.parse_args()))
