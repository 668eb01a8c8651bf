"""MiniLM served through gateway + one worker vs the same model in-process.

Starts a redis-server, a gateway and one ``embed`` worker as separate processes (as
``conveyor up`` does), drives the gateway with a closed loop of ``concurrency`` clients
for a bounded number of requests, then times the model in-process at batch 32 on the
same texts, and prints the ratio of the two throughputs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pipelines.embedded import free_port, start_redis

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "queues",
    "hold",
    "requests",
    "and",
    "workers",
    "batch",
    "them",
    "for",
    "the",
    "model",
    "which",
    "embeds",
    "every",
    "sentence",
    "into",
    "a",
    "vector",
    "of",
    "floats",
]


def texts(n: int) -> list[str]:
    """``n`` different sentences of 8 to 24 words (deterministic)."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8 + i % 17)) for i in range(n)]


@dataclass
class LoadResult:
    """Outcome of one closed-loop run."""

    requests: int
    errors: int
    seconds: float
    latencies: list[float]

    @property
    def throughput(self) -> float:
        """Successful requests per second."""
        return (self.requests - self.errors) / self.seconds

    def pct(self, q: float) -> float:
        """Latency quantile in milliseconds."""
        ordered = sorted(self.latencies)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def closed_loop(base: str, concurrency: int, total: int, path: str) -> LoadResult:
    """``concurrency`` clients, each sending its next request when the last returns."""
    corpus = texts(total)
    latencies: list[float] = []
    errors = 0
    queue = iter(range(total))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:

        async def one_client() -> None:
            nonlocal errors
            for i in queue:
                t0 = time.perf_counter()
                resp = await client.post(path, json={"text": corpus[i]})
                latencies.append(time.perf_counter() - t0)
                errors += resp.status_code != 200

        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return LoadResult(total, errors, seconds, latencies)


def in_process(total: int, batch: int) -> float:
    """Sentences per second of the model called directly at ``batch``."""
    from workers.hf import Embedder

    model = Embedder(model="minilm", device="cpu", dtype="float32", cache_dir=tempfile.gettempdir())
    corpus = [{"text": t} for t in texts(total)]
    model.predict(corpus[:batch])  # warm-up
    started = time.perf_counter()
    for i in range(0, total, batch):
        model.predict(corpus[i : i + batch])
    return total / (time.perf_counter() - started)


def served(total: int, concurrency: int, batch: int) -> LoadResult:
    """Throughput through gateway + one worker, each its own process."""
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    redis_port, http_port = free_port(), free_port()
    redis = start_redis(redis_port, workdir)
    env = dict(os.environ)
    env.update(
        CONVEYOR_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
        CONVEYOR_PORT=str(http_port),
        CONVEYOR_PIPELINES="embed",
        CONVEYOR_MAX_BATCH_SIZE=str(batch),
        CONVEYOR_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
    )
    procs = []
    with (workdir / "processes.log").open("wb") as log:
        for module in (["gateway"], ["workers", "embed"]):
            procs.append(
                subprocess.Popen([sys.executable, "-m", *module], env=env, stdout=log, stderr=log)
            )
    base = f"http://127.0.0.1:{http_port}"
    try:
        _wait_ready(base)
        asyncio.run(closed_loop(base, concurrency, 2 * batch, "/v1/embed"))  # warm-up
        return asyncio.run(closed_loop(base, concurrency, total, "/v1/embed"))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
        redis.terminate()
        redis.wait(timeout=10)


def _wait_ready(base: str) -> None:
    give_up = time.monotonic() + 120
    while time.monotonic() < give_up:
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # another process is starting
    raise RuntimeError("gateway did not become ready in 120 s")


def main(total: int = 1024, concurrency: int = 64, batch: int = 32) -> str:
    """Run the seed benchmark and return its report (markdown)."""
    load = served(total, concurrency, batch)
    limit = in_process(total, batch)
    ratio = load.throughput / limit
    return "\n".join(
        [
            "| measure | value |",
            "|---|---|",
            f"| served MiniLM, concurrency {concurrency}, {total} requests | "
            f"{load.throughput:.1f} req/s (p50 {load.pct(0.5):.0f} ms, "
            f"p99 {load.pct(0.99):.0f} ms, errors {load.errors}) |",
            f"| in-process MiniLM, batch {batch} | {limit:.1f} sentences/s |",
            f"| **ratio served / in-process** | **{ratio:.2f}** |",
            f"| mean latency (ms) | {1000 * statistics.fmean(load.latencies):.0f} |",
        ]
    )
