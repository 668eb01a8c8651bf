"""MiniLM served through gateway + one worker vs the same model in-process.

Starts a redis-server, a gateway and one ``embed`` worker as separate processes (as
``conveyor up`` does), drives the gateway with a closed loop of ``concurrency`` clients
for a bounded number of requests, then times the model in-process at batch 32 on the
same texts, and prints the ratio of the two throughputs.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from bench.loadgen import LoadResult, closed_loop
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


def bodies(n: int) -> list[bytes]:
    """``n`` JSON request bodies for ``/v1/embed``."""
    return [orjson.dumps({"text": t}) for t in texts(n)]


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


@dataclass
class Served:
    """A closed-loop run through the served stack, with what the stack reported."""

    load: LoadResult
    mean_batch: float
    cpu_s: dict[str, float] = field(default_factory=dict)


def served(total: int, concurrency: int, batch: int) -> Served:
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
        asyncio.run(
            closed_loop("127.0.0.1", http_port, "/v1/embed", bodies(2 * batch), concurrency)
        )
        before = _batch_totals(base)
        cpu0 = _cpu(procs, redis)
        result = asyncio.run(
            closed_loop("127.0.0.1", http_port, "/v1/embed", bodies(total), concurrency)
        )
        cpu1 = _cpu(procs, redis)
        after = _batch_totals(base)
        return Served(
            result,
            (after[0] - before[0]) / max(1.0, after[1] - before[1]),
            {k: cpu1[k] - cpu0[k] for k in cpu0},
        )
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
        redis.terminate()
        redis.wait(timeout=10)


def _cpu(procs: list[subprocess.Popen[bytes]], redis: subprocess.Popen[bytes]) -> dict[str, float]:
    """CPU seconds used so far by each process of the run (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")

    def of(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "gateway": of(procs[0].pid),
        "worker": of(procs[1].pid),
        "redis": of(redis.pid),
        "load client": usage.ru_utime + usage.ru_stime,
    }


def _batch_totals(base: str) -> tuple[float, float]:
    """(items, batches) the embed stage has run, from the gateway's /metrics."""
    values = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        for name in ("conveyor_stage_batch_size_sum", "conveyor_stage_batch_size_count"):
            if line.startswith(name + '{stage="embed"}'):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["conveyor_stage_batch_size_sum"], values["conveyor_stage_batch_size_count"]


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
    run = served(total, concurrency, batch)
    load = run.load
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
            f"| mean batch size served | {run.mean_batch:.1f} |",
            f"| wall time of the served run (s) | {load.seconds:.1f} |",
            *(f"| CPU seconds in {k} | {v:.1f} |" for k, v in run.cpu_s.items()),
        ]
    )
