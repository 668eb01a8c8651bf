"""``python -m bench.floor``: the least this architecture costs on this machine, measured
beside conveyor's echo in one run.

The floor is conveyor's topology with nothing on it: the same three processes and the same
hops, written straight on asyncio protocols (uvloop) with hiredis, and no more work than
those hops need.

- **serve** (the gateway's place): an HTTP/1.1 keep-alive server. It ``XADD``\\ s each
  request's body, with a fresh request id, to a stage stream, and answers it with the
  reply its blocking ``XREAD`` of a reply stream brings back.
- **work** (the worker's place): reads the stage stream with ``XREADGROUP`` (``COUNT``
  32). For each batch it makes one script call, which sets each request's done marker
  (``SET .. NX EX``: a request already done is not answered twice), writes the batch's
  replies as one entry (the body itself, an echo), and acknowledges the batch.

So a request's Redis work is exactly issue 37's "its XADD in, its reply out and its done
marker", and everything else is per batch. There is nothing else:

- no validation;
- no deadlines, cancellation, leases or on-model marks;
- no refusals, stats, metrics, tracing or logs;
- no recovery of a dead worker's entries.

It is not a server to use. It is the bound each figure of conveyor's is read against:
what the processes, their wake-ups and Redis's own work cost on these cores when no
line of conveyor runs. Two steps up from it (:data:`LADDER`) put back the libraries
conveyor stands on, one at a time: its Redis client (redis-py, with conveyor's pool and
packing), then uvicorn with httptools serving an ASGI app. What conveyor costs above the
top step is its own code (FastAPI and Starlette's layers included).

Each round starts conveyor (:func:`bench.systems.conveyor`, one echo worker) and then
each step of the ladder down to the floor, each with its own redis-server, and loads each
through HTTP with the bench's closed
loop (:mod:`bench.loadgen`) at each of ``--clients``. A measured loop follows a warm-up
loop. Around it the bench reads:

- ``CONFIG RESETSTAT`` before, and ``INFO commandstats`` after: commands per request,
  scripts' own commands counted, as ``bench.hotpath`` counts them;
- ``INFO cpu``: Redis's own CPU;
- /proc: the CPU of the two other processes.

The result is a table of medians over ``--rounds`` (every round listed), with the
conveyor/floor ratio, written as the section :data:`TITLE` of ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import redis

from bench.capacity import commandstats
from bench.floor_roles import serve, work
from bench.hotpath_report import place_section, tree
from bench.loadgen import LoadResult, closed_loop
from bench.systems import HOST, ROOT, Options, _spawn, _stop, conveyor, cpu_seconds
from bench.workloads import bodies
from conveyor.embedded import free_port, start_redis

TITLE = "The architecture's floor: conveyor's echo beside the same hops with nothing on them"
PATH = "/v1/echo"
READY = b'{"text": "ready"}'
SETTLE_S = 0.5
LADDER = {
    "floor": ("raw", "raw"),
    "floor + redis-py": ("redis-py", "raw"),
    "floor + redis-py + uvicorn": ("redis-py", "uvicorn"),
}
"""The floor and its two steps up: by name, how its roles talk to Redis and speak HTTP
(:mod:`bench.floor_roles`)."""


@dataclass
class Running:
    """A system up for the bench: where its HTTP server listens, its processes."""

    port: int
    redis_port: int
    pids: dict[str, int]


@contextmanager
def floor(workdir: Path, client: str = "raw", http: str = "raw") -> Iterator[Running]:
    """redis-server, the floor's server and its worker (talking to Redis and speaking HTTP
    as ``client`` and ``http`` say, :mod:`bench.floor_roles`), until one echo answers."""
    redis_port, port = free_port(), free_port()
    log = workdir / "floor.log"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with ExitStack() as stack:
        procs["redis"] = start_redis(redis_port, workdir / "redis-floor")
        stack.callback(_stop, procs)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        base = [sys.executable, "-m", "bench.floor"]
        common = ["--redis-port", str(redis_port), "--client", client]
        procs["serve"] = _spawn(
            [*base, "serve", *common, "--port", str(port), "--http", http], env, log
        )
        procs["work"] = _spawn([*base, "work", *common], env, log)
        running = Running(port, redis_port, {k: p.pid for k, p in procs.items()})
        _await_echo(running, procs, log)
        yield running


@contextmanager
def conveyor_echo(workdir: Path) -> Iterator[Running]:
    """conveyor as the other benches start it, serving echo."""
    with conveyor(["echo"], Options(), workdir, log_name="conveyor-floor") as server:
        pids = {role: p.pid for role, p in server.procs.items()}
        pids["serve"], pids["work"] = pids.pop("gateway"), pids.pop("worker echo 1")
        redis_port = int(server.redis_url.rsplit(":", 1)[1].split("/")[0])
        yield Running(server.port, redis_port, pids)


def _await_echo(running: Running, procs: dict[str, subprocess.Popen[bytes]], log: Path) -> None:
    give_up = time.monotonic() + 30
    while True:
        for role, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"floor {role} exited with {proc.returncode}; see {log}")
        try:
            result = asyncio.run(
                closed_loop(HOST, running.port, PATH, [READY], 1, request_timeout=1.0)
            )
            if result.requests and not result.errors:
                return
        except OSError:
            pass
        if time.monotonic() > give_up:
            raise RuntimeError(f"the floor did not answer within 30 s; see {log}")
        time.sleep(0.1)


@dataclass
class Figures:
    """One measured loop of one system at one client count, per request."""

    rate: float
    p50_ms: float
    p99_ms: float
    commands: float
    redis_us: float
    serve_us: float
    work_us: float
    errors: int


def _redis_cpu(client: redis.Redis) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def measure(running: Running, clients: int, seconds: float) -> Figures:
    """A 1 s warm-up loop, then a counted one of ``clients`` for ``seconds``."""
    sent = bodies(100_000, "echo")
    asyncio.run(closed_loop(HOST, running.port, PATH, sent, clients, duration=1.0))
    time.sleep(SETTLE_S)
    with redis.Redis(host=HOST, port=running.redis_port) as r:
        before = {role: cpu_seconds([running.pids[role]]) for role in ("serve", "work")}
        r.config_resetstat()
        redis_before = _redis_cpu(r)
        load: LoadResult = asyncio.run(
            closed_loop(HOST, running.port, PATH, sent, clients, duration=seconds)
        )
        redis_cpu = _redis_cpu(r) - redis_before
        after = {role: cpu_seconds([running.pids[role]]) for role in ("serve", "work")}
        counted = commandstats(r.info("commandstats"))
    calls = sum(c.calls for name, c in counted.items() if name != "info")
    done = max(1, load.requests - load.errors)
    return Figures(
        rate=load.throughput,
        p50_ms=load.pct(0.5),
        p99_ms=load.pct(0.99),
        commands=calls / done,
        redis_us=redis_cpu / done * 1e6,
        serve_us=(after["serve"] - before["serve"]) / done * 1e6,
        work_us=(after["work"] - before["work"]) / done * 1e6,
        errors=load.errors,
    )


SYSTEMS: dict[str, Callable[[Path], Any]] = {
    "conveyor": conveyor_echo,
    **{name: partial(floor, client=c, http=h) for name, (c, h) in reversed(LADDER.items())},
}
"""Every system measured, from conveyor down the ladder to the floor."""

ROWS = (
    ("req/s", "rate", "{:.0f}"),
    ("p50 ms", "p50_ms", "{:.2f}"),
    ("p99 ms", "p99_ms", "{:.2f}"),
    ("Redis commands", "commands", "{:.2f}"),
    ("Redis CPU µs (`INFO cpu`)", "redis_us", "{:.0f}"),
    ("gateway (serve) CPU µs", "serve_us", "{:.0f}"),
    ("worker (work) CPU µs", "work_us", "{:.0f}"),
)


def table(clients: int, runs: dict[str, list[Figures]]) -> list[str]:
    """A markdown table for one client count: each figure's median and rounds per system
    measured (``runs``, conveyor first, the floor last), and conveyor over the floor."""
    names = list(runs)
    lines = [
        f"| echo, {clients} client{'s' if clients > 1 else ''}, per request | "
        + " | ".join(f"{name} (median; rounds)" for name in names)
        + f" | {names[0]} / {names[-1]} |",
        "|---|" + "---:|" * (len(names) + 1),
    ]
    for label, attr, fmt in ROWS:
        cells, medians = [], []
        for name in names:
            values = [getattr(f, attr) for f in runs[name]]
            median = statistics.median(values)
            medians.append(median)
            rounds = ", ".join(fmt.format(v) for v in values)
            cells.append(f"**{fmt.format(median)}** ({rounds})")
        ratio = f"{medians[0] / medians[-1]:.2f}x" if medians[-1] else "-"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {ratio} |")
    errors = {name: sum(f.errors for f in runs[name]) for name in names}
    if any(errors.values()):
        lines.append(f"\nErrors: {errors}.")
    return lines


def section(command: str, results: dict[int, dict[str, list[Figures]]], took_s: float) -> str:
    """The :data:`TITLE` section of ``RESULTS.md``."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out = [
        f"## {TITLE}",
        "",
        f"Written by `{command}` on {when} in {took_s:.0f} s; {tree()[2:]}. "
        "What the floor is, and what it leaves out: `bench/floor.py`'s docstring. Each "
        "round starts each system afresh; medians, with every round. Conveyor's figures "
        "over the floor's are what conveyor's own code costs on top of the hops.",
        "",
    ]
    for clients, runs in results.items():
        out += [*table(clients, runs), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__)
    parser.add_argument("role", nargs="?", choices=("serve", "work"), help=argparse.SUPPRESS)
    parser.add_argument("--redis-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", choices=("raw", "redis-py"), help=argparse.SUPPRESS)
    parser.add_argument("--http", choices=("raw", "uvicorn"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated, of: {', '.join(SYSTEMS)} (the last is the ratios' base)",
    )
    parser.add_argument("--clients", default="1,64", help="closed-loop clients, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0, help="per measured loop")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    args = parser.parse_args(argv)
    if args.role is not None:
        import uvloop

        if args.role == "serve":
            uvloop.run(serve(args.redis_port, args.port, args.client, args.http))
        else:
            uvloop.run(work(args.redis_port, args.client))
        return
    counts = [int(c) for c in args.clients.split(",")]
    names = args.systems.split(",")
    if unknown := set(names) - set(SYSTEMS):
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    results: dict[int, dict[str, list[Figures]]] = {c: {s: [] for s in names} for c in counts}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for j, name in enumerate(names):
                workdir = Path(tmp) / f"{i}-{j}"
                workdir.mkdir()
                with SYSTEMS[name](workdir) as running:
                    for clients in counts:
                        figures = measure(running, clients, args.seconds)
                        results[clients][name].append(figures)
                        print(f"round {i + 1} {name} c={clients}: {figures}", flush=True)
    command = "python -m bench.floor " + " ".join(argv if argv is not None else sys.argv[1:])
    body = section(command.strip(), results, time.monotonic() - started)
    print(body)
    text = args.out.read_text() if args.out.exists() else ""
    args.out.write_text(place_section(text, TITLE, body))


if __name__ == "__main__":
    main()
