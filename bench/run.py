"""Drive every system with closed-loop load and collect one row per measurement."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.loadgen import LoadResult, closed_loop, open_loop
from bench.systems import HOST, STARTERS, Options, Server, conveyor
from bench.workloads import TOKENIZED, InProcess, bodies, in_process, stage_of, stages_of
from conveyor.embedded import free_port, start_redis

logger = logging.getLogger(__name__)

SYSTEMS = ("conveyor", "conveyor-items", "in-process", "celery", "hf-batching", "litserve")
SIDE_BY_SIDE = ("conveyor", "conveyor-items")
"""Systems run at the same time, their measurements alternating, so that a change in the
machine's speed during the run touches both alike: the two batching modes are compared by
their ratio."""
ONE_STAGE_AT_A_TIME = ("litserve",)
"""Systems started afresh for each stage: an idle LitServe inference worker polls its
queue every millisecond, and idle ones would take CPU from the one measured."""


@dataclass
class Plan:
    """What one run measures.

    Attributes:
        systems: which of :data:`SYSTEMS`.
        workloads: which of :data:`bench.workloads.WORKLOADS`.
        concurrencies: closed-loop clients, one measurement each.
        requests: at most this many requests per measurement.
        seconds: a measurement stops sending after about this long.
        warmup_s: each measurement is preceded by this much load, not counted.
        scale_workers: conveyor worker counts for the synthetic scaling sweep.
        scale_clients_per_worker: clients per worker in that sweep (two full batches
            keep a worker busy: one running, one forming).
        scale_cost_ms: synthetic's (a, b) in the sweep: heavy enough that N workers'
            ideal throughput stays well under what the serving path's CPU can carry.
        embed_threads: also measure embed with torch held to each of these thread
            counts, in-process and on conveyor (at the top concurrency).
        options: how the systems are configured.
    """

    systems: list[str]
    workloads: list[str]
    concurrencies: list[int]
    requests: int
    seconds: float
    warmup_s: float
    scale_workers: list[int]
    scale_clients_per_worker: int
    scale_cost_ms: tuple[float, float] = (250.0, 10.0)
    embed_threads: list[int] = field(default_factory=list)
    options: Options = field(default_factory=Options)


@dataclass
class Row:
    """One closed-loop measurement of one system.

    Attributes:
        system: which system.
        workload: which workload.
        concurrency: clients in flight.
        workers: worker processes serving the workload (conveyor's scaling sweep).
        load: what the clients saw.
        mean_batch: items per model call over the measurement.
        cpu_ms: CPU milliseconds the system's processes spent per successful request.
        padding: real / padded tokens of the batches run over the measurement (None:
            not counted, or no tokenizer).
    """

    system: str
    workload: str
    concurrency: int
    workers: int
    load: LoadResult
    mean_batch: float
    cpu_ms: float
    padding: float | None = None


@dataclass
class Overload:
    """synthetic on one conveyor worker, offered twice what it can serve (open loop).

    Attributes:
        capacity: requests per second the worker served in a closed loop just before.
        offered: requests per second sent (2 x capacity).
        deadline_s: every request's deadline (``X-Conveyor-Timeout``).
        admitted: latencies (s) of the requests answered 200.
        refused: latencies (s) of the requests refused with 503.
        late: requests answered 504 (admitted, then the deadline passed).
        other: any other outcome.
    """

    capacity: float
    offered: float
    deadline_s: float
    admitted: list[float]
    refused: list[float]
    late: int
    other: int


@dataclass
class Wake:
    """What a loopback round trip costs on this machine, busy and after idling.

    Attributes:
        busy_us: median round trip of a raw PING to redis-server, back to back.
        idle_us: the same, each after the client slept ``gap_s``.
        gap_s: the idle time before each ping of ``idle_us``.
    """

    busy_us: float
    idle_us: float
    gap_s: float


def wake_latency(workdir: Path, gap_s: float = 0.02, count: int = 200) -> Wake:
    """Time raw PING round trips to a fresh redis-server, back to back and after idling.

    A served request crosses processes several times (client, gateway, Redis, worker);
    one that arrives after a quiet spell finds them asleep, and on a virtual machine
    waking an idle CPU costs more than the message itself. This measures that cost here,
    without any client library, so the c=1 figures can be read against it.
    """
    port = free_port()
    proc = start_redis(port, workdir / "redis-wake")
    try:
        with socket.create_connection((HOST, port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def ping() -> float:
                started = time.perf_counter()
                sock.sendall(b"PING\r\n")
                sock.recv(64)
                return time.perf_counter() - started

            for _ in range(50):
                ping()
            busy = statistics.median(ping() for _ in range(count * 5))
            idle = []
            for _ in range(count):
                time.sleep(gap_s)
                idle.append(ping())
    finally:
        proc.terminate()
        proc.wait(10)
    return Wake(busy * 1e6, statistics.median(idle) * 1e6, gap_s)


@dataclass
class Results:
    """Everything one run measured.

    Attributes:
        plan: what was asked for.
        rows: closed-loop measurements of the served systems.
        scaling: conveyor's synthetic scaling sweep.
        overload: conveyor under twice the load it can serve.
        limits_before: the in-process model, measured before the served systems.
        limits_after: the same, measured again after them (the machine's drift).
        started: when the run began (local time).
        wall_s: how long it took.
        load_avg: the 1-minute load average at the start and at the end (noise check).
        wake: loopback round trips, busy and after idling.
        threads: embed with torch held to N threads: (N, in-process, conveyor).
    """

    plan: Plan
    rows: list[Row] = field(default_factory=list)
    scaling: list[Row] = field(default_factory=list)
    overload: Overload | None = None
    limits_before: dict[str, InProcess] = field(default_factory=dict)
    limits_after: dict[str, InProcess] = field(default_factory=dict)
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M %Z"))
    wall_s: float = 0.0
    load_avg: tuple[float, float] = (0.0, 0.0)
    wake: Wake | None = None
    threads: list[tuple[int, InProcess, Row]] = field(default_factory=list)

    @property
    def limits(self) -> dict[str, InProcess]:
        """The in-process model, per workload: the stricter of its measurements before
        and after the served systems."""
        return {
            w: _stricter(lim, self.limits_after.get(w)) for w, lim in self.limits_before.items()
        }

    def row(self, system: str, workload: str, concurrency: int) -> Row | None:
        """The measurement of (system, workload, concurrency), if taken."""
        for r in self.rows:
            if (r.system, r.workload, r.concurrency) == (system, workload, concurrency):
                return r
        return None


def measure(server: Server, workload: str, concurrency: int, plan: Plan, workers: int = 1) -> Row:
    """Warm up, then one bounded closed-loop measurement of ``workload`` on ``server``."""
    before: list[tuple[float, float] | None] = []
    tokens_before: list[tuple[float, float] | None] = []
    cpu_before: list[float] = []

    def snapshot() -> None:  # as the measurement starts, after the warm-up
        cpu_before.append(server.cpu_seconds())  # first: /proc answers at once, HTTP may wait
        before.append(server.batch_totals(workload))
        tokens_before.append(server.token_totals(workload))

    load = asyncio.run(
        closed_loop(
            HOST,
            server.port,
            server.path(workload),
            bodies(plan.requests, workload),
            concurrency,
            duration=plan.seconds,
            warmup=plan.warmup_s,
            on_measure=snapshot,
        )
    )
    cpu = server.cpu_seconds() - cpu_before[0]
    for role, proc in server.procs.items():
        if proc.poll() is not None:  # the figures below are then not the system's own
            logger.warning("%s: %s exited with %s", server.name, role, proc.returncode)
    after = server.batch_totals(workload)
    mean_batch = 1.0
    if before[0] is not None and after is not None:
        mean_batch = (after[0] - before[0][0]) / max(1.0, after[1] - before[0][1])
    padding = _padding(tokens_before[0], server.token_totals(workload))
    if padding is None and after is None and workload in TOKENIZED:
        padding = 1.0  # every batch is one item: nothing to pad
    ok = max(1, load.requests - load.errors)
    row = Row(
        server.name, workload, concurrency, workers, load, mean_batch, 1000 * cpu / ok, padding
    )
    logger.info(
        "%-14s %-9s c=%-3d N=%d  %7.1f req/s  p50 %6.1f ms  p99 %6.1f ms  errors %d  "
        "batch %.1f  padding %s  cpu %.2f ms/req",
        row.system,
        workload,
        concurrency,
        workers,
        load.throughput,
        load.pct(0.5),
        load.pct(0.99),
        load.errors,
        mean_batch,
        "-" if padding is None else f"{padding:.2f}",
        row.cpu_ms,
    )
    return row


def _padding(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Real / padded tokens between two (real, padded) readings (None: not counted)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _runs_on(system: str, workload: str) -> bool:
    """Whether ``system`` is measured on ``workload``: the item-count conveyor only where
    batches pad (on the others its batches are the default's)."""
    return system != "conveyor-items" or workload in TOKENIZED


def sessions(plan: Plan) -> list[dict[str, list[str]]]:
    """The served systems' runs, in order: each run starts its systems (with the
    workloads each is measured on) together and stops them together."""
    chosen = [s for s in STARTERS if s in plan.systems]
    out = [{s: list(plan.workloads) for s in chosen if s in SIDE_BY_SIDE}]
    for system in chosen:
        if system in ONE_STAGE_AT_A_TIME:
            out += [
                {system: [w for w in plan.workloads if stage_of(w) == stage]}
                for stage in stages_of(plan.workloads)
            ]
        elif system not in SIDE_BY_SIDE:
            out.append({system: list(plan.workloads)})
    runs = [{s: [w for w in ws if _runs_on(s, w)] for s, ws in run.items()} for run in out]
    return [{s: ws for s, ws in run.items() if ws} for run in runs if any(run.values())]


def run(plan: Plan) -> Results:
    """Measure every selected system on every selected workload, one system at a time.

    The in-process limit is taken first, while nothing else runs; each served system is
    then started, driven at every concurrency, and stopped before the next one starts.
    """
    results = Results(plan)
    began = time.monotonic()
    load_start = os.getloadavg()[0]
    if "in-process" in plan.systems:
        results.limits_before = _limits(plan, "before the served systems")
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    logger.info("process logs under %s", workdir)
    results.wake = wake_latency(workdir)
    logger.info(
        "loopback PING: %.0f us back to back, %.0f us after %.0f ms idle",
        results.wake.busy_us,
        results.wake.idle_us,
        results.wake.gap_s * 1000,
    )
    for session in sessions(plan):
        names = " and ".join(session)
        served = dict.fromkeys(w for workloads in session.values() for w in workloads)
        logger.info("starting %s (%s)", names, ", ".join(served))
        with ExitStack() as stack:
            servers = {
                system: stack.enter_context(STARTERS[system](workloads, plan.options, workdir))
                for system, workloads in session.items()
            }
            for workload in plan.workloads:
                for concurrency in plan.concurrencies:
                    for system, server in servers.items():  # side by side: alternating
                        if workload in session[system]:
                            results.rows.append(measure(server, workload, concurrency, plan))
        logger.info("stopped %s", names)
    if results.limits_before and results.rows:
        # Measured again once the served systems are done: a VM's speed drifts, and a
        # ratio against a limit taken at another speed would say more of the host.
        results.limits_after = _limits(plan, "after the served systems")
    if "conveyor" in plan.systems and "synthetic" in plan.workloads and plan.scale_workers:
        results.scaling = _scaling(plan, workdir)
        results.overload = _overload(plan, workdir)
    if {"conveyor", "in-process"} <= set(plan.systems) and "embed" in plan.workloads:
        results.threads = [_embed_at(n, plan, workdir) for n in plan.embed_threads]
    results.wall_s = time.monotonic() - began
    results.load_avg = (load_start, os.getloadavg()[0])
    return results


def _limits(plan: Plan, when: str) -> dict[str, InProcess]:
    """The in-process model of every selected workload, measured now."""
    limits = {}
    for workload in plan.workloads:
        limit = in_process(
            workload,
            batch=plan.options.max_batch,
            total=max(plan.requests, 4 * plan.options.max_batch),
            singles=plan.requests,
            seconds=min(plan.seconds, 10.0),
            device=plan.options.device,
        )
        limits[workload] = limit
        logger.info(
            "in-process  %-9s batch %d: %.1f items/s; batch 1: p50 %.2f ms, p99 %.2f ms (%s)",
            workload,
            limit.batch,
            limit.throughput,
            limit.single_p50_ms,
            limit.single_p99_ms,
            when,
        )
    return limits


def _stricter(a: InProcess, b: InProcess | None) -> InProcess:
    """The harder bar of two measurements of one limit: the higher throughput and the
    lower single-item latency."""
    if b is None:
        return a
    single = min(a, b, key=lambda lim: lim.single_p50_ms)
    return InProcess(
        a.workload,
        a.batch,
        max(a.throughput, b.throughput),
        single.single_p50_ms,
        single.single_p99_ms,
        a.padding,
    )


def _scaling(plan: Plan, workdir: Path) -> list[Row]:
    """synthetic on conveyor with more and more workers, clients growing in proportion."""
    a_ms, b_ms = plan.scale_cost_ms
    env = {"BENCH_SYNTHETIC_A_MS": f"{a_ms:g}", "BENCH_SYNTHETIC_B_MS": f"{b_ms:g}"}
    options = replace(plan.options, env={**plan.options.env, **env})
    logger.info("starting conveyor for the scaling sweep (synthetic %g + %g ms/item)", a_ms, b_ms)
    rows = []
    with conveyor(["synthetic"], options, workdir, log_name="conveyor-scaling") as server:
        for count in sorted(plan.scale_workers):
            server.scale("synthetic", count)
            clients = plan.scale_clients_per_worker * count
            rows.append(measure(server, "synthetic", clients, plan, workers=count))
    return rows


def _embed_at(threads: int, plan: Plan, workdir: Path) -> tuple[int, InProcess, Row]:
    """embed with torch held to ``threads``, in this process and on conveyor's worker."""
    batch = plan.options.max_batch
    limit = in_process(
        "embed",
        batch=batch,
        total=max(plan.requests, 4 * batch),
        singles=plan.requests,
        seconds=min(plan.seconds, 10.0),
        device=plan.options.device,
        threads=threads,
    )
    logger.info(
        "in-process  embed     batch %d at %d thread(s): %.1f items/s",
        batch,
        threads,
        limit.throughput,
    )
    env = {**plan.options.env, "CONVEYOR_THREADS": str(threads)}
    options = replace(plan.options, env=env)
    top = max(plan.concurrencies)
    with conveyor(["embed"], options, workdir, log_name=f"conveyor-threads-{threads}") as server:
        row = measure(server, "embed", top, plan)
    return threads, limit, row


def _overload(plan: Plan, workdir: Path, deadline_s: float = 2.0) -> Overload:
    """Measure one synthetic worker's capacity, then offer it twice that, open loop, with
    a deadline on every request: admission should refuse the surplus at once (503) and
    keep what it admits inside the deadline."""
    a_ms, b_ms = plan.scale_cost_ms
    env = {"BENCH_SYNTHETIC_A_MS": f"{a_ms:g}", "BENCH_SYNTHETIC_B_MS": f"{b_ms:g}"}
    options = replace(plan.options, env={**plan.options.env, **env})
    with conveyor(["synthetic"], options, workdir, log_name="conveyor-overload") as server:
        capacity = measure(server, "synthetic", plan.scale_clients_per_worker, plan)
        rate = 2 * capacity.load.throughput
        count = max(20, int(rate * plan.seconds))
        logger.info(
            "overload: capacity %.1f/s, offering %.1f/s for %d requests",
            capacity.load.throughput,
            rate,
            count,
        )
        header = f"X-Conveyor-Timeout: {deadline_s:g}\r\n"
        got = asyncio.run(
            open_loop(HOST, server.port, server.path("synthetic"), bodies(count), rate, header)
        )
    return Overload(
        capacity=capacity.load.throughput,
        offered=rate,
        deadline_s=deadline_s,
        admitted=[t for s, t in got if s == 200],
        refused=[t for s, t in got if s == 503],
        late=sum(1 for s, _ in got if s == 504),
        other=sum(1 for s, _ in got if s not in (200, 503, 504)),
    )
