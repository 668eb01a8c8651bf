"""``python -m bench.floor``: the least this architecture costs on this machine, measured
beside conveyor in one run.

The floor is conveyor's topology with nothing on it: its three processes and the least
hops they need, written straight on asyncio protocols (uvloop) with hiredis.

- **serve** (the gateway's place): an HTTP/1.1 keep-alive server. It ``XADD``\\ s each
  request's body, with a fresh request id, to a stage stream, and answers it with the
  reply its blocking ``XREAD`` of a reply stream brings back.
- **work** (the worker's place): reads the stage stream with ``XREADGROUP`` (``COUNT``
  32). Each batch takes the model's time (``--model-ms``; it sleeps), then one script
  call sets each request's done marker (``SET .. NX EX``: a request already done is not
  answered twice), writes the batch's replies as one entry (the body itself, an echo),
  and acknowledges the batch.

A request's Redis work is so its XADD in, its reply out and its done marker, and
everything else is per batch: two round trips a batch for the worker, where conveyor's
makes a third (its cancellation check and on-model marks, when the model is free for the
batch). There is nothing else:

- no validation;
- no deadlines, cancellation, leases or on-model marks;
- no refusals, stats, metrics, tracing or logs;
- no recovery of a dead worker's entries.

It is not a server to use. It is the bound conveyor's figures are read against: what the
processes, their wake-ups and Redis's own work cost on these cores when no line of
conveyor runs. Two steps up from it (:data:`LADDER`) put back the libraries conveyor
stands on, one at a time: its Redis client (redis-py, with conveyor's pool and packing),
then uvicorn with httptools serving an ASGI app. What conveyor costs above the top step is
its own code (FastAPI's and Starlette's layers included) and its third round trip.

The loads: echo (no model) at each of ``--clients``, and one client behind each of
``--models``: a model of that many ms per batch (conveyor's synthetic stage held to that
time, the floor's worker sleeping as long), or ``minilm``, MiniLM on the CPU (conveyor's
``embed`` stage; the floor's worker runs the same model as
:func:`bench.workloads.load_model` builds it, with torch's idle threads as a conveyor
worker leaves them). At one client every process idles while another works, and on a VM
an idle process's wake-up is dear; a model's time makes each idle as long as a real
model's would. MiniLM on the CPU also takes the cores the other processes wake on. Its
own time for one request, the base of its p50 over the model, is measured in the
bench's process at the start of each round, as ``python -m bench`` measures it.

Each round starts each system afresh (its own redis-server), in an order turned by one
each round, and loads it through HTTP with the bench's closed loop (:mod:`bench.loadgen`).
A measured loop follows a warm-up loop. Around it the bench reads:

- ``CONFIG RESETSTAT`` before, and ``INFO commandstats`` after: commands per request,
  scripts' own commands counted, as ``bench.hotpath`` counts them;
- ``INFO cpu``: Redis's own CPU;
- /proc: the CPU of the two other processes, a second after the loop (what a process
  defers to its idle time counts).

The result is a table per load of medians over ``--rounds`` (every round listed), with
conveyor over the ladder's top step and over the floor, written as the section
:data:`TITLE` of ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
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
from urllib.parse import urlsplit

import redis

from bench.capacity import commandstats, redis_cpu
from bench.floor_roles import serve, work
from bench.hotpath_report import place_section, tree
from bench.loadgen import LoadResult, closed_loop
from bench.systems import (
    HOST,
    ROOT,
    Options,
    Server,
    _spawn,
    _stop,
    _stop_all_but_redis,
    _wait_answers,
    conveyor,
    cpu_seconds,
)
from bench.workloads import bodies, in_process
from conveyor.embedded import free_port, start_redis
from workers.settings import WorkerSettings

TITLE = "The architecture's floor: conveyor beside the same hops with nothing on them"
SETTLE_S = 1.0
"""Idle before each counted loop, and after it before CPU and Redis are read."""
WARMUP_S = 1.0
"""The uncounted loop before each counted one."""
LADDER = {
    "floor": ("raw", "raw"),
    "floor + redis-py": ("redis-py", "raw"),
    "floor + redis-py + uvicorn": ("redis-py", "uvicorn"),
}
"""The floor and its two steps up: by name, how its roles talk to Redis and speak HTTP
(:mod:`bench.floor_roles`)."""


@dataclass
class Running:
    """A system up for the bench: where its HTTP server listens (and the path it serves),
    its Redis, its processes."""

    port: int
    path: str
    redis_port: int
    pids: dict[str, int]


@contextmanager
def floor(
    workdir: Path, client: str = "raw", http: str = "raw", model: str = "0"
) -> Iterator[Running]:
    """redis-server, the floor's server and its worker (talking to Redis and speaking HTTP
    as ``client`` and ``http`` say, running ``model``: :mod:`bench.floor_roles`), until
    one request is answered."""
    redis_port = free_port()
    port = free_port(avoid=redis_port)
    log = workdir / "floor.log"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with ExitStack() as stack:
        procs["redis"] = start_redis(redis_port, workdir / "redis-floor")
        stack.callback(_stop, {"redis": procs["redis"]})
        stack.callback(_stop_all_but_redis, procs)  # runs first: Redis's clients, then Redis
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        base = [sys.executable, "-m", "bench.floor"]
        common = ["--redis-port", str(redis_port), "--client", client]
        procs["serve"] = _spawn(
            [*base, "serve", *common, "--port", str(port), "--http", http], env, log
        )
        if model == "minilm":  # torch's idle threads as a conveyor worker leaves them
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            env.setdefault("GOMP_SPINCOUNT", str(WorkerSettings().openmp_spin_count))
        procs["work"] = _spawn([*base, "work", *common, "--model", model], env, log)
        _wait_answers(Server("floor", port, procs), ["echo"], log)
        yield Running(port, "/v1/echo", redis_port, {k: p.pid for k, p in procs.items()})


@contextmanager
def conveyor_served(workdir: Path, model: str = "0") -> Iterator[Running]:
    """conveyor as the other benches start it, serving ``echo`` (``model`` 0), ``embed``
    (``minilm``) or the synthetic stage held to ``model`` ms per batch
    (:mod:`bench.synthetic`)."""
    workload = {"0": "echo", "minilm": "embed"}.get(model, "synthetic")
    env = {"BENCH_SYNTHETIC_A_MS": model, "BENCH_SYNTHETIC_B_MS": "0"}
    options = Options(env=env if workload == "synthetic" else {})
    with conveyor([workload], options, workdir, log_name="conveyor-floor") as server:
        pids = {role: p.pid for role, p in server.procs.items()}
        pids["serve"], pids["work"] = pids.pop("gateway"), pids.pop(f"worker {workload} 1")
        redis_port = int(urlsplit(server.redis_url).port or 6379)
        yield Running(server.port, server.path(workload), redis_port, pids)


@dataclass
class Figures:
    """One measured loop of one system at one load, per request."""

    rate: float
    p50_ms: float
    over_ms: float
    p99_ms: float
    commands: float
    redis_us: float
    serve_us: float
    work_us: float
    errors: int


def measure(running: Running, clients: int, seconds: float, model_ms: float = 0.0) -> Figures:
    """A warm-up loop, then a counted one of ``clients`` for ``seconds``; CPU and Redis
    are read :data:`SETTLE_S` after it (what a process defers to its idle time counts).
    ``model_ms``: the model's own time for one request (the p50 over it)."""
    sent = bodies(100_000, "echo")
    asyncio.run(closed_loop(HOST, running.port, running.path, sent, clients, duration=WARMUP_S))
    time.sleep(SETTLE_S)
    with redis.Redis(host=HOST, port=running.redis_port) as r:
        before = {role: cpu_seconds([running.pids[role]]) for role in ("serve", "work")}
        r.config_resetstat()
        redis_before = redis_cpu(r)
        load: LoadResult = asyncio.run(
            closed_loop(HOST, running.port, running.path, sent, clients, duration=seconds)
        )
        time.sleep(SETTLE_S)
        redis_used = redis_cpu(r) - redis_before
        after = {role: cpu_seconds([running.pids[role]]) for role in ("serve", "work")}
        counted = commandstats(r.info("commandstats"))
    calls = sum(c.calls for name, c in counted.items() if name != "info")
    done = max(1, load.requests - load.errors)
    return Figures(
        rate=load.throughput,
        p50_ms=load.pct(0.5),
        over_ms=load.pct(0.5) - model_ms,
        p99_ms=load.pct(0.99),
        commands=calls / done,
        redis_us=redis_used / done * 1e6,
        serve_us=(after["serve"] - before["serve"]) / done * 1e6,
        work_us=(after["work"] - before["work"]) / done * 1e6,
        errors=load.errors,
    )


SYSTEMS: dict[str, Callable[..., Any]] = {
    "conveyor": conveyor_served,
    **{name: partial(floor, client=c, http=h) for name, (c, h) in reversed(LADDER.items())},
}
"""Every system measured, from conveyor down the ladder to the floor; each is started
with a workdir and a model time (ms per batch)."""

ROWS = (
    ("req/s", "rate", "{:.0f}"),
    ("p50 ms", "p50_ms", "{:.2f}"),
    ("p50 over the model, ms", "over_ms", "{:.2f}"),
    ("p99 ms", "p99_ms", "{:.2f}"),
    ("Redis commands", "commands", "{:.2f}"),
    ("Redis CPU µs (`INFO cpu`)", "redis_us", "{:.0f}"),
    ("gateway (serve) CPU µs", "serve_us", "{:.0f}"),
    ("worker (work) CPU µs", "work_us", "{:.0f}"),
)

Load = tuple[str, int]
"""A measured load: the model (``0``: echo; a number: that many ms a batch, sleeping;
``minilm``) and the clients."""


def _title(load: Load) -> str:
    model, clients = load
    who = f"{clients} client{'s' if clients > 1 else ''}"
    if model == "minilm":
        return f"MiniLM, {who}"
    return f"a {model} ms model, {who}" if model != "0" else f"echo, {who}"


def table(load: Load, runs: dict[str, list[Figures]]) -> list[str]:
    """A markdown table for one load: each figure's median and rounds per system measured
    (``runs``: conveyor first, the floor last), and conveyor over the top step of the
    ladder (what its own code adds) and over the floor."""
    names = list(runs)
    lines = [
        f"| {_title(load)}, per request | "
        + " | ".join(f"{name} (median; rounds)" for name in names)
        + f" | {names[0]} / {names[1]} | {names[0]} / {names[-1]} |",
        "|---|" + "---:|" * (len(names) + 2),
    ]
    for label, attr, fmt in ROWS:
        cells, medians = [], []
        for name in names:
            values = [getattr(f, attr) for f in runs[name]]
            median = statistics.median(values)
            medians.append(median)
            rounds = ", ".join(fmt.format(v) for v in values)
            cells.append(f"**{fmt.format(median)}** ({rounds})")
        ratios = [f"{medians[0] / m:.2f}x" if m > 0 else "-" for m in (medians[1], medians[-1])]
        lines.append(f"| {label} | " + " | ".join(cells + ratios) + " |")
    errors = {name: sum(f.errors for f in runs[name]) for name in names}
    if any(errors.values()):
        lines.append(f"\nErrors: {errors}.")
    return lines


def section(command: str, results: dict[Load, dict[str, list[Figures]]], notes: str) -> str:
    """The :data:`TITLE` section of ``RESULTS.md``."""
    out = [
        f"## {TITLE}",
        "",
        f"Written by `{command}` {notes}; {tree()[2:]}. What the floor is, and what it "
        "leaves out: `bench/floor.py`'s docstring. Each round starts each system afresh, "
        "in an order turned by one each round; medians, with every round. A model of some ms "
        "is conveyor's synthetic stage held to that time per batch (it sleeps), and the "
        "floor's worker sleeping as long; MiniLM is conveyor's embed stage and the same "
        "model in the floor's worker, its p50 over the model taken against the model "
        "alone in the bench's process, measured each round. Conveyor over the top step "
        "of the ladder is what its own code adds; over the floor, that and the libraries.",
        "",
    ]
    for load, runs in results.items():
        out += [*table(load, runs), ""]
    return "\n".join(out)


def _loadavg() -> float:
    return os.getloadavg()[0]


def run(
    names: list[str], loads: list[Load], rounds: int, seconds: float
) -> dict[Load, dict[str, list[Figures]]]:
    """Every system at every load, ``rounds`` times, each system started afresh per model,
    the systems' order turned by one each round. MiniLM's own time for one request is
    measured in this process at the start of each round (:func:`bench.workloads.in_process`)."""
    results: dict[Load, dict[str, list[Figures]]] = {load: {n: [] for n in names} for load in loads}
    models = list(dict.fromkeys(model for model, _ in loads))
    tmp = Path(tempfile.mkdtemp(prefix="floor-"))
    for i in range(rounds):
        alone = {m: float(m) for m in models if m != "minilm"}
        if "minilm" in models:
            lim = in_process("embed", batch=32, total=64, singles=200, seconds=4, device="cpu")
            alone["minilm"] = lim.single_p50_ms
            print(f"round {i + 1} MiniLM alone: p50 {lim.single_p50_ms:.2f} ms", flush=True)
        for name in names[i % len(names) :] + names[: i % len(names)]:
            for model in models:
                workdir = tmp / f"{i}-{name.replace(' ', '')}-{model}"
                workdir.mkdir()
                with SYSTEMS[name](workdir, model=model) as running:
                    for load in loads:
                        if load[0] == model:
                            figures = measure(running, load[1], seconds, alone[model])
                            results[load][name].append(figures)
                            print(f"round {i + 1} {name} {_title(load)}: {figures}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)  # kept, with its logs, where a system failed
    return results


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
        help=f"comma-separated, of: {', '.join(SYSTEMS)} (conveyor first, the floor last)",
    )
    parser.add_argument("--clients", default="1,64", help="echo's closed-loop clients")
    parser.add_argument(
        "--models",
        default="20,minilm",
        help="also one client behind each of these models: a number of ms per batch (a "
        "model that sleeps) or minilm ('': none)",
    )
    parser.add_argument("--model", default="0", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0, help="per measured loop")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    args = parser.parse_args(argv)
    if args.role is not None:
        import uvloop

        if args.role == "serve":
            uvloop.run(serve(args.redis_port, args.port, args.client, args.http))
        else:
            uvloop.run(work(args.redis_port, args.client, args.model))
        return
    names = args.systems.split(",")
    if unknown := set(names) - set(SYSTEMS):
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    loads: list[Load] = [("0", int(c)) for c in args.clients.split(",") if c]
    loads += [(m, 1) for m in args.models.split(",") if m]
    started, load_before = time.monotonic(), _loadavg()
    results = run(names, loads, args.rounds, args.seconds)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    notes = (
        f"on {when} in {time.monotonic() - started:.0f} s, load average (1 min) "
        f"{load_before:.2f} at the start and {_loadavg():.2f} at the end"
    )
    command = "python -m bench.floor " + " ".join(argv if argv is not None else sys.argv[1:])
    body = section(command.strip(), results, notes)
    print(body)
    text = args.out.read_text() if args.out.exists() else ""
    args.out.write_text(place_section(text, TITLE, body))


if __name__ == "__main__":
    main()
