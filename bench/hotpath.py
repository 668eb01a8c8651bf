"""The hot path's cost: Redis's work and each process's round trips per request, and where
one request's time goes.

``python -m bench.hotpath`` starts conveyor as :mod:`bench.capacity` does (redis-server,
the gateway, one worker: :func:`bench.systems.conveyor`) for each of ``--workloads``
(``echo``, no model; ``embed``, MiniLM) and loads it through HTTP with the bench's closed
loop at each of ``--clients``. Each interval below is one whole closed loop after a warm-up
loop, so every request of it is counted and no other:

- **counted**: ``CONFIG RESETSTAT`` before it; ``INFO commandstats`` (calls and µs by
  command; Redis 7 counts a command a script or a MULTI/EXEC runs under its own name too),
  ``INFO cpu`` and ``INFO stats`` (socket reads) after; the gateway's and the worker's CPU
  (/proc); batches from the stage's stats hash.
- **watched**: the same load under ``MONITOR``. Each client connection is given to its
  process (its local port found among the process's sockets in /proc); a ``lua`` line is
  a script's. A connection's commands that reach Redis within ``--gap-ms`` of each other,
  with no other connection's command between, count as one round trip (:func:`round_trips`).
- **traced**, at one client: a second conveyor exporting OpenTelemetry spans to a receiver
  here, under ``MONITOR`` for the server times of each request's XADD, cancel check and
  script call; each request's time is cut at those edges (:data:`STEPS`).

It writes the section :data:`TITLE` of ``--out`` (``bench/RESULTS.md``), keeping the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis

from bench.capacity import commandstats, redis_cpu
from bench.hotpath_report import (
    COMMAND,
    SETTLE_S,
    TITLE,
    Counted,
    Measured,
    per_request,
    place_section,
    section,
    tree,
)
from bench.hotpath_spans import STEPS, Span, breakdown, decode, receiver, server_times
from bench.hotpath_watch import (
    LUA,
    Event,
    Monitor,
    client_roles,
    parse_line,
    round_trips,
    shape,
    socket_ports,
    tally,
)
from bench.loadgen import LoadResult, closed_loop
from bench.systems import HOST, ConveyorServer, Options, conveyor, cpu_seconds
from bench.workloads import bodies, stage_of
from pipelines.keys import Keys

__all__ = [  # what the tests read here, wherever it is defined
    "COMMAND",
    "LUA",
    "STEPS",
    "TITLE",
    "Event",
    "Span",
    "breakdown",
    "decode",
    "main",
    "parse_line",
    "place_section",
    "round_trips",
    "server_times",
    "shape",
    "socket_ports",
    "tally",
]


def _stage_totals(client: redis.Redis, stage: str) -> tuple[float, float]:
    """(items, batches) the stage has run, from its stats hash (the publish script's)."""
    key = Keys(os.environ.get("CONVEYOR_NAMESPACE", "conveyor")).stage_stats(stage)
    items, batches = client.hmget(key, ["h:batch_size:sum", "batches"])
    return float(items or 0), float(batches or 0)


def _pids(server: ConveyorServer) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"gateway": [], "worker": []}
    for role, proc in server.procs.items():
        if role != "redis":
            out["gateway" if role.startswith("gateway") else "worker"].append(proc.pid)
    return out


def _port(server: ConveyorServer) -> int:
    return int(urlsplit(server.redis_url).port or 6379)


def _loop(
    server: ConveyorServer,
    workload: str,
    clients: int,
    n: int,
    seconds: float,
    before: Callable[[], object],
) -> LoadResult:
    """A 1 s warm-up loop, ``before()``, then a closed loop of at most ``n`` requests and
    ``seconds``: all of its requests and their Redis work, and only those, between
    ``before`` and the return (:data:`SETTLE_S` after either loop)."""
    path, sent = f"/v1/{stage_of(workload)}", bodies(n, workload)
    asyncio.run(closed_loop(HOST, server.port, path, sent, clients, duration=1.0))
    time.sleep(SETTLE_S)
    before()
    result = asyncio.run(closed_loop(HOST, server.port, path, sent, clients, duration=seconds))
    time.sleep(SETTLE_S)
    return result


def count(server: ConveyorServer, workload: str, clients: int, seconds: float) -> Counted:
    """One closed loop between ``CONFIG RESETSTAT`` and the reads."""
    pids, stage = _pids(server), stage_of(workload)
    start: dict[str, Any] = {}
    with redis.Redis(host=HOST, port=_port(server), decode_responses=True) as r:

        def reset() -> None:  # after the warm-up loop, before the measured one
            start["cpu"] = {role: cpu_seconds(p) for role, p in pids.items()}
            start["ran"] = _stage_totals(r, stage)
            r.config_resetstat()
            start["redis"] = redis_cpu(r)

        result = _loop(server, workload, clients, 20_000, seconds, reset)
        commands = commandstats(r.info("commandstats"))
        used = redis_cpu(r) - start["redis"]
        reads = int(r.info("stats")["total_reads_processed"])
        items, batches = (a - b for a, b in zip(_stage_totals(r, stage), start["ran"], strict=True))
    commands.pop("info", None)  # this bench's own reads
    gateway, worker = (cpu_seconds(p) - start["cpu"][role] for role, p in pids.items())
    return Counted(clients, result, items, batches, commands, used, reads, gateway, worker)


def watch(
    server: ConveyorServer, workload: str, clients: int, seconds: float, n: int = 20_000
) -> tuple[list[Event], dict[str, str], LoadResult]:
    """One closed loop (after a warm-up) under ``MONITOR``: what Redis ran, the role of
    each client connection, and the loop's outcome."""
    monitors: list[Monitor] = []
    try:
        result = _loop(
            server, workload, clients, n, seconds, lambda: monitors.append(Monitor(_port(server)))
        )
        roles = client_roles(_pids(server))  # while the pools' connections are open
    finally:
        events = monitors[0].stop() if monitors else []
    return events, roles, result


def measure(workload: str, args: argparse.Namespace, workdir: Path) -> Measured:
    """Counted and watched per load on one conveyor; then traced on another."""
    counted, watched = [], []
    with conveyor([workload], Options(), workdir, log_name=f"hotpath-{workload}") as server:
        for clients in (int(n) for n in args.clients.split(",")):
            counted.append(count(server, workload, clients, args.seconds))
            events, roles, _ = watch(server, workload, clients, args.watch_seconds)
            watched.append(tally(events, roles, args.gap_ms / 1000))
            c, w = counted[-1], watched[-1]
            calls = sum(x.calls for x in c.commands.values()) / c.requests
            print(
                f"{workload}, {clients} clients: {c.requests} ok, p50 {c.result.pct(0.5):.2f} "
                f"ms; per request {calls:.1f} commands, {1e6 * c.redis_cpu_s / c.requests:.0f} "
                f"us Redis CPU, round trips: gateway {w.per_request('gateway'):.2f}, worker "
                f"{w.per_request('worker'):.2f}",
                flush=True,
            )
    with receiver() as (endpoint, exported):
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
        env["OTEL_BSP_MAX_QUEUE_SIZE"] = "65536"  # every span kept
        options, log = Options(env=env), f"hotpath-{workload}-traced"
        with conveyor([workload], options, workdir, log_name=log) as server:
            events, _, traced = watch(server, workload, 1, 60.0, n=args.traced)
            time.sleep(1.0)  # the exporters' last batches
    pieces = breakdown(decode(exported), stage_of(workload), server_times(events))
    return Measured(counted, watched, pieces, traced)


def main(argv: list[str] | None = None) -> None:
    """Measure every workload and write the section."""
    parser = argparse.ArgumentParser(prog="python -m bench.hotpath", description=__doc__)
    parser.add_argument("--workloads", default="echo", help="echo and/or embed, comma-separated")
    parser.add_argument("--clients", default="1,64", help="closed-loop clients, comma-separated")
    parser.add_argument("--seconds", type=float, default=6.0, help="per counted interval")
    parser.add_argument("--watch-seconds", type=float, default=3.0, help="per MONITOR interval")
    parser.add_argument("--traced", type=int, default=1000, help="requests traced at 1 client")
    parser.add_argument("--gap-ms", type=float, default=0.2, help="a round trip's longest gap")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    parser.add_argument(
        "--json", type=Path, help="also write each load's per-request figures here (bench.sitting)"
    )
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    from bench.report import machine  # imports torch: only once the arguments are good

    began, load_before, code = time.monotonic(), os.getloadavg()[0], tree()
    with tempfile.TemporaryDirectory(prefix="conveyor-hotpath-") as tmp:
        measured = {w: measure(w, args, Path(tmp)) for w in args.workloads.split(",")}
    took, load_avg = time.monotonic() - began, (load_before, os.getloadavg()[0])
    if (now := tree()) != code:  # someone changed the code while it ran
        code += f"; when the run ended: {now.removeprefix('- Code: ')}"
    text = section(measured, args, machine(), code, took, load_avg)
    old = args.out.read_text() if args.out.exists() else ""
    args.out.write_text(place_section(old, TITLE, text))
    if args.json is not None:
        figures = {
            workload: [per_request(c, w) for c, w in zip(m.counted, m.watched, strict=True)]
            for workload, m in measured.items()
        }
        args.json.write_text(json.dumps(figures, indent=1, ensure_ascii=False))
    print(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
