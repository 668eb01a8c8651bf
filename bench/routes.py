"""``python -m bench.routes``: what one route costs the gateway against another, on a stage
that answers at once (so the gateway's work is what is measured, not a model's).

Starts conveyor as ``python -m bench`` does (redis-server, the gateway, one worker) with
this module's one stage, ``instant`` (``openai="embeddings"``: it answers every text with
the same 384 floats, MiniLM's size), and drives it with the bench's closed loop of
keep-alive HTTP clients, one text a request, through ``--routes`` in turn, alternating for
``--rounds``:

- ``native``: ``POST /v1/instant`` (``{"text": ...}``);
- ``openai``: ``POST /v1/embeddings`` (``{"model": "instant", "input": ...}``);
- ``openai-list``: the same with :data:`LIST` texts a request (its figures are per HTTP
  request, each of :data:`LIST` requests through the stage);
- ``jobs``: ``POST /v1/jobs/instant`` (``{"text": ...}``), answered 202 once queued; the
  stage runs the jobs meanwhile, in the bulk lane, and the next round starts once it has
  run the last one.

Per route and round: requests/s (while every client was busy), p50 latency, and the
gateway's CPU µs per request (``/proc``, from the end of the warm-up to the end of the
round). It prints a Markdown table: medians, every round, and each route against the
first. Compare within one run: the machine's speed drifts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import closed_loop
from bench.systems import Options, conveyor, cpu_seconds
from bench.workloads import texts
from pipelines.graph import Pipeline, single
from pipelines.model import Item, Result
from pipelines.stages import Stage, TextIn

STAGE = "instant"
VECTOR = [round(0.001 * i, 3) for i in range(384)]
"""What ``instant`` answers for every text (MiniLM's width)."""


class Instant:
    """Embeds every text as :data:`VECTOR`, at once."""

    def predict(self, items: list[Item]) -> list[Result]:
        return [{"embedding": VECTOR} for _ in items]


def pipelines() -> list[Pipeline]:
    """What the bench's gateway serves (``CONVEYOR_APP=bench.routes:pipelines``)."""
    return [single(Stage(STAGE, TextIn, runner="bench.routes:Instant", openai="embeddings"))]


def _native(text: str) -> dict[str, str]:
    return {"text": text}


def _openai(text: str) -> dict[str, str]:
    return {"model": STAGE, "input": text}


def _openai_list(text: str) -> dict[str, Any]:
    return {"model": STAGE, "input": [f"{text} {i}" for i in range(LIST)]}


LIST = 16
"""Texts in one request of the ``openai-list`` route."""

ROUTES: dict[str, tuple[str, Callable[[str], dict[str, Any]]]] = {
    "native": (f"/v1/{STAGE}", _native),
    "openai": ("/v1/embeddings", _openai),
    "openai-list": ("/v1/embeddings", _openai_list),
    "jobs": (f"/v1/jobs/{STAGE}", _native),
}
"""Each route's path and request body for a text."""


@dataclass
class Rounds:
    """One route's figures, a value per round."""

    rate: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    gateway_us: list[float] = field(default_factory=list)


async def _round(
    port: int, gateway: int, route: str, args: argparse.Namespace
) -> tuple[float, ...]:
    path, body = ROUTES[route]
    bodies = [json.dumps(body(t)).encode() for t in texts(args.requests)]
    marks: list[float] = []
    last: list[bytes] = [b""]  # the last job accepted

    def accepted(status: int, payload: bytes) -> None:
        if status == 202:
            last[0] = payload

    result = await closed_loop(
        "127.0.0.1",
        port,
        path,
        bodies,
        args.clients,
        duration=args.seconds,
        warmup=args.warmup,
        on_measure=lambda: marks.append(cpu_seconds([gateway])),
        ok=202 if route == "jobs" else 200,
        on_response=accepted,
    )
    used = cpu_seconds([gateway]) - marks[0]
    if last[0]:  # the stage runs the jobs after: the next round starts once it has
        await _drained(port, json.loads(last[0])["id"])
    if result.errors:
        raise SystemExit(
            f"{route}: {result.errors} of {result.requests} requests failed: {result.statuses}"
        )
    rate = result.steady_ok / max(result.steady_seconds, 1e-9)
    return rate, 1e3 * statistics.median(result.latencies), 1e6 * used / result.requests


async def _drained(port: int, job: str, limit_s: float = 300.0) -> None:
    """Wait until ``job``, the last one a round submitted, has left the queue (the stage
    takes its bulk lane in order: the earlier ones have, too)."""
    give_up = time.monotonic() + limit_s
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        while (await http.get(f"/v1/jobs/{job}")).json()["status"] == "queued":
            if time.monotonic() > give_up:
                raise SystemExit(f"jobs: job {job} still queued after {limit_s:g} s")
            await asyncio.sleep(0.05)  # polled: a job's reader has nothing to await


def _row(name: str, values: dict[str, list[float]], routes: list[str], fmt: str) -> str:
    first = statistics.median(values[routes[0]])
    cells = []
    for route in routes:
        median = statistics.median(values[route])
        rounds = ", ".join(format(v, fmt) for v in values[route])
        cells.append(f"**{median:{fmt}}** ({rounds})")
    ratios = [f"{statistics.median(values[r]) / first:.2f}x" for r in routes[1:]]
    return f"| {name} | {' | '.join(cells)} | {' | '.join(ratios)} |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.routes", description=__doc__)
    parser.add_argument("--routes", default="native,openai", help="comma-separated, in turn")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="per measured round")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--requests", type=int, default=4000, help="most per round")
    args = parser.parse_args(argv)
    routes = args.routes.split(",")
    unknown = sorted(set(routes) - set(ROUTES))
    if unknown:
        parser.error(f"unknown route(s) {', '.join(unknown)}; known: {', '.join(ROUTES)}")
    figures = {r: Rounds() for r in routes}
    with (
        tempfile.TemporaryDirectory() as workdir,
        conveyor([STAGE], Options(), Path(workdir), app="bench.routes:pipelines") as server,
    ):
        gateway = server.procs["gateway"].pid
        for _ in range(args.rounds):
            for route in routes:
                rate, p50, us = asyncio.run(_round(server.port, gateway, route, args))
                figures[route].rate.append(rate)
                figures[route].p50_ms.append(p50)
                figures[route].gateway_us.append(us)
    print(
        f"`python -m bench.routes --routes {args.routes} --clients {args.clients} "
        f"--rounds {args.rounds} --seconds {args.seconds:g}`\n"
    )
    against = " | ".join(f"{r} / {routes[0]}" for r in routes[1:])
    print(f"| figure | {' | '.join(f'{r} (median; rounds)' for r in routes)} | {against} |")
    print("|---|" + "---:|" * (2 * len(routes) - 1))
    print(_row("req/s", {r: f.rate for r, f in figures.items()}, routes, ".0f"))
    print(_row("p50 ms", {r: f.p50_ms for r, f in figures.items()}, routes, ".1f"))
    print(
        _row("gateway CPU µs/request", {r: f.gateway_us for r, f in figures.items()}, routes, ".0f")
    )


if __name__ == "__main__":
    main()
