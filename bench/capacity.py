"""Capacity from measurement: what one request costs Redis, the gateway and the workers,
per pipeline hop, at batch 1 and at batch ~32.

``python -m bench.capacity`` starts conveyor (redis-server, the gateway, one worker per
stage) for each of three pipelines of echo stages (:data:`pipelines`; no model, so only
serving is measured): one hop, a chain of three, and the shape of the built-in
``wiki-summary`` (a step, a step, a fan-out to two steps, a join: five stage runs). Each
is loaded through real HTTP by the bench's closed loop under each ``--loads``: 1 client
(every batch one item, every process idle between requests), 64 clients with batches
bounded at 1 (batch 1 with Redis busy), and 64 and 256 clients with batches of up to 32.
For each measurement it reads:

- Redis: ``CONFIG RESETSTAT`` as the measurement starts, then ``INFO commandstats``
  (calls and server microseconds per command) and the server's CPU (``INFO cpu``,
  ``used_cpu_sys + used_cpu_user``) when it ends. Redis 7 counts a command a script runs
  twice: inside ``EVALSHA``'s time and again under its own name. Which calls came from a
  script is read from ``MONITOR`` during the warm-up (its lines name the source, ``lua``
  or a client address), and only top-level time is summed.
- the gateway's and the workers' CPU (/proc, :func:`bench.systems.cpu_seconds`);
- the mean batch from the gateway's ``conveyor_stage_batch_size`` counters.

From the one-hop and three-hop chains it fits cost = fixed + hops x per-hop, checks the
fit against the five-run pipeline, and sizes a deployment for ``--target`` requests/s
with every process held to ``--headroom`` of a core. It writes ``bench/CAPACITY.md``.

With ``--shards S --partitions P[,P...]`` it measures partitioned streams instead: each
round it runs the one- and three-hop chains on one redis-server with one partition (the
default deployment) and then, alternating, with each ``P`` on a loopback Redis Cluster of
``S`` masters (:func:`conveyor.embedded.cluster`, AOF off as on the single server; every
process given ``CONVEYOR_REDIS_URL=redis+cluster://...`` and ``CONVEYOR_PARTITIONS=P``).
``CONFIG RESETSTAT``, ``INFO commandstats``, ``INFO cpu`` and ``MONITOR`` run on every
node; Redis's cost is summed over the nodes and each node's share of it reported. It
rewrites only the :data:`PARTITIONED` section of ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import redis

from bench.loadgen import closed_loop
from bench.report import machine
from bench.systems import HOST, ConveyorServer, Options, cpu_seconds, parse_metrics, total
from bench.systems import conveyor as start_conveyor
from bench.workloads import bodies
from conveyor.embedded import Cluster, cluster
from pipelines.graph import Pipeline, function, model
from pipelines.stages import AnyIn, Stage

ECHO = "workers.models.toy:Echo"
A, B, C, D = (Stage(f"cap-{n}", AnyIn, ECHO, summary="Echo.") for n in "abcd")


def _first_branch(branches: dict[str, Any]) -> dict[str, Any]:
    """The join: answer one branch's output (both are the request)."""
    out: dict[str, Any] = branches["c"]
    return out


pipelines: list[Pipeline] = [
    Pipeline("cap1", AnyIn, (model("a", A),)),
    Pipeline("cap3", AnyIn, (model("a", A, then="b"), model("b", B, then="c"), model("c", C))),
    Pipeline(
        "capwiki",
        AnyIn,
        (
            model("a", A, then="b"),
            model("b", B, then=("c", "d")),
            model("c", C, then="e"),
            model("d", D, then="e"),
            function("e", _first_branch, join=("c", "d")),
        ),
    ),
]
"""Echo pipelines of 1, 3 and 5 stage runs (``CONVEYOR_APP=bench.capacity:pipelines``);
``capwiki`` has ``wiki-summary``'s shape: fetch, sentiment, summarize + ner, combine."""

HOPS = {p.name: len(p.steps) for p in pipelines}
"""Stage runs per request."""

SCRIPTS = frozenset({"evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro"})
CONTAINERS = frozenset({"config", "client", "xinfo", "xgroup", "script", "object", "memory"})
"""Commands that commandstats names with their subcommand (``xinfo|stream``)."""

_MONITOR = re.compile(rb'^\+\d+\.\d+ \[\d+ ([^\]]+)\] "([^"]*)"(?: "([^"]*)")?')


@dataclass
class Calls:
    """One command's ``INFO commandstats`` line: calls and server microseconds."""

    calls: int
    usec: int


def commandstats(info: Mapping[str, Any]) -> dict[str, Calls]:
    """Calls and microseconds by command from redis-py's parsed ``INFO commandstats``,
    without the ``CONFIG RESETSTAT`` that started the count."""
    out = {}
    for key, stat in info.items():
        name = key.removeprefix("cmdstat_")
        if key.startswith("cmdstat_") and name != "config|resetstat":
            out[name] = Calls(int(stat["calls"]), int(stat["usec"]))
    return out


def sum_commandstats(nodes: Iterable[Mapping[str, Calls]]) -> dict[str, Calls]:
    """Calls and microseconds by command, added up over the nodes of a cluster."""
    out: dict[str, Calls] = {}
    for node in nodes:
        for name, c in node.items():
            had = out.get(name, Calls(0, 0))
            out[name] = Calls(had.calls + c.calls, had.usec + c.usec)
    return out


def shares(values: Sequence[float]) -> list[float]:
    """Each value's share of their sum (all zero where the sum is)."""
    whole = sum(values)
    return [v / whole if whole else 0.0 for v in values]


def monitor_command(line: bytes) -> tuple[str, bool] | None:
    """The command of one ``MONITOR`` line (as commandstats names it) and whether a
    script ran it; None for a line that is no command (``+OK``)."""
    found = _MONITOR.match(line)
    if found is None:
        return None
    source, name, sub = found.groups()
    command = name.decode().lower()
    if command in CONTAINERS and sub is not None:
        command = f"{command}|{sub.decode().lower()}"
    return command, source == b"lua"


def scripted_shares(seen: Counter[tuple[str, bool]]) -> dict[str, float]:
    """Per command, the share of its calls that a script ran."""
    names = {name for name, _ in seen}
    return {n: seen[n, True] / (seen[n, True] + seen[n, False]) for n in names}


def top_level_usec(commands: Mapping[str, Calls], scripted: Mapping[str, float]) -> float:
    """Server microseconds of the commands clients sent: a script's inner commands are
    already inside its ``EVALSHA``, so their share of each command is left out."""
    return sum(c.usec * (1 - scripted.get(name, 0.0)) for name, c in commands.items())


def script_own_usec(commands: Mapping[str, Calls], scripted: Mapping[str, float]) -> float:
    """Microseconds the scripts spent outside the commands they ran (Lua, decoding)."""
    scripts = sum(c.usec for name, c in commands.items() if name in SCRIPTS)
    inner = sum(c.usec * scripted.get(name, 0.0) for name, c in commands.items())
    return scripts - inner


def open_monitor(host: str, port: int) -> tuple[socket.socket, bytes]:
    """A connection in ``MONITOR`` mode (watching from its ``+OK`` on: nothing before
    counts), reads timing out each 0.1 s; and what came after the ``+OK`` already."""
    sock = socket.create_connection((host, port), timeout=10)
    sock.sendall(b"MONITOR\r\n")
    reply = b""
    while b"\r\n" not in reply:
        if not (chunk := sock.recv(1 << 16)):
            raise ConnectionError("Redis closed the connection to MONITOR")
        reply += chunk
    answer, _, rest = reply.partition(b"\r\n")
    if answer != b"+OK":
        raise ConnectionError(f"MONITOR answered {answer!r}")
    sock.settimeout(0.1)
    return sock, rest


class Monitor:
    """Counts the commands Redis runs by (command, run by a script) over ``MONITOR``."""

    def __init__(self, host: str, port: int) -> None:
        self.seen: Counter[tuple[str, bool]] = Counter()
        self._sock, self._rest = open_monitor(host, port)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        rest = self._rest
        while not self._done.is_set():
            try:
                chunk = self._sock.recv(1 << 16)
            except TimeoutError:
                continue  # nothing ran: look at the flag again
            if not chunk:
                return
            *lines, rest = (rest + chunk).split(b"\r\n")
            for line in lines:
                if (seen := monitor_command(line)) is not None:
                    self.seen[seen] += 1

    def stop(self) -> dict[str, float]:
        """Stop watching (again: nothing more); the scripted share of each command seen."""
        if not self._done.is_set():
            self._done.set()
            self._thread.join()
            self._sock.close()
        return scripted_shares(self.seen)


@dataclass(frozen=True, order=True)
class Load:
    """How a pipeline is loaded: ``clients`` in a closed loop, batches of at most
    ``max_batch`` (``CONVEYOR_MAX_BATCH_SIZE`` of every worker)."""

    clients: int
    max_batch: int

    @classmethod
    def parse(cls, text: str) -> Load:
        """``"64x32"``: 64 clients, batches of at most 32."""
        clients, _, max_batch = text.partition("x")
        return cls(int(clients), int(max_batch or 32))

    def __str__(self) -> str:
        return f"{self.clients} client{'s' * (self.clients > 1)}, max batch {self.max_batch}"


@dataclass(frozen=True)
class Layout:
    """Where the streams live: ``partitions`` per stage over ``shards`` Redis masters
    (1: one redis-server, no cluster; 3 or more: a Redis Cluster, which needs 3)."""

    partitions: int = 1
    shards: int = 1

    def __str__(self) -> str:
        where = "one redis-server" if self.shards == 1 else f"{self.shards} shards"
        return f"P={self.partitions} on {where}"


SINGLE = Layout()
"""Today's deployment: one redis-server, one partition."""


@dataclass
class Point:
    """One pipeline under one load, measured.

    Attributes:
        pipeline: which of :data:`pipelines`.
        load: clients and batch bound.
        round: which round of the run.
        requests: requests answered 200 in the measurement.
        errors: other answers.
        rps: requests answered per second (steady part).
        batch: mean items per batch over the pipeline's stages.
        redis_cpu_s: redis-server's CPU seconds over the measurement.
        commands: ``INFO commandstats`` over the measurement.
        scripted: per command, the share of its calls scripts ran (from the warm-up).
        gateway_cpu_s: the gateway's CPU seconds.
        workers_cpu_s: every worker's CPU seconds together.
        layout: partitions and shards.
        shard_cpu_s: each Redis node's CPU seconds (they add up to ``redis_cpu_s``).
        shard_calls: each Redis node's command calls, scripts' inner calls included.
    """

    pipeline: str
    load: Load
    round: int
    requests: int
    errors: int
    rps: float
    batch: float
    redis_cpu_s: float
    commands: dict[str, Calls]
    scripted: dict[str, float] = field(default_factory=dict)
    gateway_cpu_s: float = 0.0
    workers_cpu_s: float = 0.0
    layout: Layout = SINGLE
    shard_cpu_s: list[float] = field(default_factory=list)
    shard_calls: list[int] = field(default_factory=list)

    @property
    def hops(self) -> int:
        """Stage runs per request."""
        return HOPS[self.pipeline]

    def per_request(self) -> dict[str, float]:
        """Redis CPU and top-level command µs, gateway and workers CPU µs, per request."""
        n = max(1, self.requests)
        return {
            "redis_cpu": 1e6 * self.redis_cpu_s / n,
            "redis_cmd": top_level_usec(self.commands, self.scripted) / n,
            "gateway": 1e6 * self.gateway_cpu_s / n,
            "workers": 1e6 * self.workers_cpu_s / n,
        }


def redis_cpu(client: redis.Redis) -> float:
    """Redis's own CPU seconds so far (``INFO cpu``: system + user)."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def _batches(server: ConveyorServer, stages: Iterable[str]) -> tuple[float, float]:
    """(items, batches) the stages have run, from the gateway's ``/metrics``."""
    m = parse_metrics(httpx.get(f"http://{HOST}:{server.port}/metrics", timeout=10).text)
    items = sum(total(m, "conveyor_stage_batch_size_sum", stage=s) or 0.0 for s in stages)
    runs = sum(total(m, "conveyor_stage_batch_size_count", stage=s) or 0.0 for s in stages)
    return items, runs


def measure(
    server: ConveyorServer,
    name: str,
    load: Load,
    seconds: float,
    warmup: float,
    round_no: int,
    nodes: Cluster | None = None,
    layout: Layout = SINGLE,
) -> Point:
    """Load ``server``'s pipeline ``name`` with ``load.clients`` and read what it cost
    (``server`` bounds batches at ``load.max_batch``; its Redis is ``nodes``, or the
    redis-server of its URL)."""
    stages = [s.name for s in next(p for p in pipelines if p.name == name).stages()]
    gateway = [server.procs["gateway"].pid]
    workers = [p.pid for role, p in server.procs.items() if role.startswith("worker ")]
    ports = nodes.ports if nodes else [int(urlsplit(server.redis_url).port or 6379)]
    clients = [redis.Redis(host=HOST, port=port, decode_responses=True) for port in ports]
    monitors = [Monitor(HOST, port) for port in ports]
    start: dict[str, Any] = {}

    def begin() -> None:  # as the measurement starts, after the warm-up
        seen: Counter[tuple[str, bool]] = Counter()
        for monitor in monitors:
            monitor.stop()
            seen.update(monitor.seen)
        start["scripted"] = scripted_shares(seen)
        start["batches"] = _batches(server, stages)
        start["gateway"] = cpu_seconds(gateway)
        start["workers"] = cpu_seconds(workers)
        for client in clients:
            client.config_resetstat()
        start["redis"] = [redis_cpu(client) for client in clients]

    sent = bodies(20_000 if load.clients > 1 else 5_000, "echo")
    try:
        result = asyncio.run(
            closed_loop(
                *(HOST, server.port, f"/v1/{name}", sent, load.clients),
                duration=seconds,
                warmup=warmup,
                on_measure=begin,
            )
        )
        per_node = [commandstats(c.info("commandstats")) for c in clients]
        shard_cpu = [redis_cpu(c) - was for c, was in zip(clients, start["redis"], strict=True)]
        gateway_cpu = cpu_seconds(gateway) - start["gateway"]
        workers_cpu = cpu_seconds(workers) - start["workers"]
        items, runs = _batches(server, stages)
    finally:
        for monitor in monitors:
            monitor.stop()  # already, unless the load failed before measuring
        for client in clients:
            client.close()
    return Point(
        pipeline=name,
        load=load,
        round=round_no,
        requests=result.statuses.get(200, 0),
        errors=result.errors,
        rps=result.throughput,
        batch=(items - start["batches"][0]) / max(1.0, runs - start["batches"][1]),
        redis_cpu_s=sum(shard_cpu),
        commands=sum_commandstats(per_node),
        scripted=start["scripted"],
        gateway_cpu_s=gateway_cpu,
        workers_cpu_s=workers_cpu,
        layout=layout,
        shard_cpu_s=shard_cpu,
        shard_calls=[sum(c.calls for c in node.values()) for node in per_node],
    )


@contextmanager
def _clusters(layouts: Iterable[Layout], workdir: Path) -> Iterator[dict[int, Cluster]]:
    """One loopback Redis Cluster per shard count of ``layouts`` (beyond one), its
    nodes' AOF off, as on the single redis-server the other layouts use."""
    with ExitStack() as stack:
        made: dict[int, Cluster] = {}
        for shards in sorted({layout.shards for layout in layouts} - {1}):
            made[shards] = stack.enter_context(cluster(workdir / f"cluster-{shards}", shards))
            for port in made[shards].ports:
                with redis.Redis(host=HOST, port=port) as node:
                    node.config_set("appendonly", "no")
        yield made


def _flush(nodes: Cluster) -> None:
    """Empty every node, so a conveyor inherits no streams from the one before."""
    for port in nodes.ports:
        with redis.Redis(host=HOST, port=port) as node:
            node.flushall()


def run(
    rounds: int,
    loads: list[Load],
    seconds: float,
    warmup: float,
    workdir: Path,
    layouts: Sequence[Layout] = (SINGLE,),
    names: Sequence[str] = tuple(HOPS),
) -> list[Point]:
    """Every pipeline of ``names`` under every load in every layout, ``rounds`` times
    (the layouts alternating within a round); a fresh conveyor per layout, pipeline,
    batch bound and round, so no measurement inherits another's streams."""
    points = []
    with _clusters(layouts, workdir) as clusters:
        for round_no in range(1, rounds + 1):
            for layout in layouts:
                for p in (p for p in pipelines if p.name in names):
                    for bound in sorted({load.max_batch for load in loads}):
                        nodes = clusters.get(layout.shards)
                        if nodes:
                            _flush(nodes)
                        options = Options(
                            max_batch=bound, env={"CONVEYOR_PARTITIONS": str(layout.partitions)}
                        )
                        with start_conveyor(
                            [p.name],
                            options,
                            workdir,
                            log_name=f"{p.name}-{bound}-{round_no}-{layout.partitions}"
                            f"-{layout.shards}",
                            app="bench.capacity:pipelines",
                            workers=[s.name for s in p.stages()],
                            redis_url=nodes.url.replace("redis://", "redis+cluster://")
                            if nodes
                            else None,
                        ) as server:
                            for load in (load for load in loads if load.max_batch == bound):
                                points.append(
                                    measure(
                                        *(server, p.name, load, seconds, warmup, round_no),
                                        nodes=nodes,
                                        layout=layout,
                                    )
                                )
                                print(_line(points[-1]), flush=True)
    return points


def _line(p: Point) -> str:
    cost = p.per_request()
    where = "" if p.layout == SINGLE else f" ({p.layout}, shares {_shares(p.shard_cpu_s)})"
    return (
        f"round {p.round} {p.pipeline}{where}, {p.load}: {p.requests} ok, {p.errors} errors, "
        f"{p.rps:.0f}/s, batch {p.batch:.1f}; per request: Redis CPU {cost['redis_cpu']:.0f} us, "
        f"commands {cost['redis_cmd']:.0f} us, gateway {cost['gateway']:.0f} us, "
        f"workers {cost['workers']:.0f} us"
    )


KEYS = {
    "redis_cpu": "Redis CPU",
    "redis_cmd": "Redis commands",
    "gateway": "gateway CPU",
    "workers": "workers CPU",
}
"""The costs per request, as the tables name them (µs)."""


def fit(one: Point, three: Point) -> dict[str, tuple[float, float]]:
    """Per cost: (fixed, per hop) µs per request, from cost = fixed + hops x per hop
    through the one-hop and the three-hop chain."""
    a, b = one.per_request(), three.per_request()
    out = {}
    for key in KEYS:
        hop = (b[key] - a[key]) / (three.hops - one.hops)
        out[key] = (a[key] - one.hops * hop, hop)
    return out


def _shares(values: Sequence[float]) -> str:
    """Each node's share, ``34/33/33%``."""
    return "/".join(f"{100 * s:.0f}" for s in shares(values)) + "%"


def _points(points: list[Point], pipeline: str, load: Load, layout: Layout = SINGLE) -> list[Point]:
    return [p for p in points if (p.pipeline, p.load, p.layout) == (pipeline, load, layout)]


def _fits(
    points: list[Point], load: Load, layout: Layout = SINGLE
) -> list[dict[str, tuple[float, float]]]:
    """The fit of every round under ``load`` in ``layout``."""
    ones, threes = _points(points, "cap1", load, layout), _points(points, "cap3", load, layout)
    return [fit(a, b) for a, b in zip(ones, threes, strict=True)]


def _spread(values: list[float]) -> str:
    """``mean`` or ``mean (lo-hi, ±x%)`` over rounds."""
    mean = sum(values) / len(values)
    if len(values) < 2 or not mean:
        return f"{mean:.0f}"
    half = (max(values) - min(values)) / 2
    return f"{mean:.0f} ({min(values):.0f}-{max(values):.0f}, ±{100 * half / mean:.0f}%)"


def _mean(values: Iterable[float]) -> float:
    listed = list(values)
    return sum(listed) / len(listed)


@dataclass
class Sizing:
    """What ``target`` requests/s of one pipeline takes, each process at ``headroom``.

    Attributes:
        redis_us: Redis CPU µs per request.
        per_shard: requests/s one shard (one Redis core) carries.
        shards: shards for the target.
        gateways: gateway processes.
        workers: echo worker processes, all stages together.
    """

    redis_us: float
    per_shard: float
    shards: int
    gateways: int
    workers: int


def size(cost: Mapping[str, float], target: float, headroom: float) -> Sizing:
    """Size for ``target`` requests/s from per-request µs ``cost`` (see :data:`KEYS`)."""
    core = 1e6 * headroom  # busy µs one process may spend per second
    return Sizing(
        redis_us=cost["redis_cpu"],
        per_shard=core / cost["redis_cpu"],
        shards=math.ceil(target * cost["redis_cpu"] / core),
        gateways=math.ceil(target * cost["gateway"] / core),
        workers=math.ceil(target * cost["workers"] / core),
    )


COMMAND = "HF_HUB_OFFLINE=1 python -m bench.capacity"
PARTITIONS_PER_SHARD = 4

NAMES = {
    "cap1": "1 hop (echo, embed)",
    "cap3": "3-hop chain",
    "capwiki": "wiki-summary's shape (5 stage runs)",
}


def _per_call(points: list[Point], name: str) -> tuple[float, float, float]:
    """(calls, µs) per request of command ``name``, and its scripted share, over rounds."""
    calls = _mean(p.commands.get(name, Calls(0, 0)).calls / max(1, p.requests) for p in points)
    usec = _mean(p.commands.get(name, Calls(0, 0)).usec / max(1, p.requests) for p in points)
    return calls, usec, _mean(p.scripted.get(name, 0.0) for p in points)


def _by_command(points: list[Point], load: Load) -> list[str]:
    ones, threes = _points(points, "cap1", load), _points(points, "cap3", load)
    names = sorted({n for p in ones + threes for n in p.commands})
    rows = []
    for name in names:
        calls, one, scripted = _per_call(ones, name)
        _, three, _ = _per_call(threes, name)
        rows.append((three, name, calls, one, scripted))
    out = [
        "| command | run by a script | calls/request, 1 hop | µs/call | µs/request, 1 hop "
        "| µs/request, 3 hops | per extra hop |",
        "|---|---|---|---|---|---|---|",
    ]
    for three, name, calls, one, scripted in sorted(rows, reverse=True):
        if three < 0.05 and one < 0.05:
            continue
        per_call = one / calls if calls else 0.0
        out.append(
            f"| {name.upper()} | {100 * scripted:.0f}% | {calls:.2f} | {per_call:.1f} | "
            f"{one:.1f} | {three:.1f} | {(three - one) / 2:.1f} |"
        )
    one = _mean(script_own_usec(p.commands, p.scripted) / p.requests for p in ones)
    three = _mean(script_own_usec(p.commands, p.scripted) / p.requests for p in threes)
    out.append(
        f"| of EVALSHA, the script itself (less the commands it ran) | | | | {one:.1f} "
        f"| {three:.1f} | {(three - one) / 2:.1f} |"
    )
    one = _mean(p.per_request()["redis_cmd"] for p in ones)
    three = _mean(p.per_request()["redis_cmd"] for p in threes)
    out.append(
        f"| **top level** (scripts' commands counted once, in EVALSHA) | | | | **{one:.1f}** "
        f"| **{three:.1f}** | **{(three - one) / 2:.1f}** |"
    )
    return out


def markdown(
    points: list[Point], args: argparse.Namespace, took: float, load_avg: tuple[float, float]
) -> str:
    """The report: every measurement, the per-hop fit, the commands, the sizing."""
    loads = list(dict.fromkeys(p.load for p in points))
    rounds = max(p.round for p in points)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Capacity: what a request costs Redis, the gateway and the workers",
        "",
        f"Written by `{COMMAND}` on {stamp} in {took:.0f} s ({rounds} rounds; "
        f"{'; '.join(map(str, loads))}; {args.seconds:g} s per measurement after "
        f"{args.warmup:g} s of warm-up); rerun it to refresh this file. Load average (1 min) "
        f"{load_avg[0]:.2f} at the start, {load_avg[1]:.2f} at the end.",
        "",
        "## Machine",
        "",
        *machine(),
        "- Redis, the gateway, the workers and the load generator share these cores, so the "
        "requests/s below are this machine's, not a deployment's. What carries over is cost "
        "per request. Redis's CPU (`INFO cpu`) is what fills a shard's core: command "
        "execution plus reading, parsing and writing on its sockets. `INFO commandstats` "
        "times command execution alone, and moves least from round to round, but it is "
        "elapsed time on Redis's thread: where that thread lost its core mid-command (load "
        "average well above 0), it can read above the CPU figure. Batch-1 figures include "
        "waking idle processes for every command, which a busy deployment pays less often.",
        "",
        "## How it is measured",
        "",
        "Three pipelines of echo stages (`workers.models.toy:Echo`, no model), each served by "
        "a fresh redis-server, gateway and one worker per stage, loaded through HTTP by the "
        "bench's closed loop: `cap1` (one stage, what `echo` or `embed` are), `cap3` (a chain "
        "of three) and `capwiki` (wiki-summary's shape: a step, a step, a fan-out to two "
        "steps, a function step that joins them). `CONFIG RESETSTAT` as the measurement "
        "starts; `INFO commandstats` and `INFO cpu` (`used_cpu_sys + used_cpu_user`) as it "
        "ends. Redis 7.0 counts a command run by a script twice: inside `EVALSHA` and under "
        "its own name; which share of each command's calls a script made is read from "
        "`MONITOR` during the warm-up, and only top-level time is summed. Gateway and "
        "worker CPU come from /proc; the mean batch from the gateway's "
        "`conveyor_stage_batch_size` counters (all stages of the pipeline). A hop is one "
        "stage run of one item; cost = fixed + hops x per hop is fitted through `cap1` and "
        "`cap3`, and checked on `capwiki`.",
        "",
        "## Every measurement (µs per request)",
        "",
        "| round | pipeline | stage runs | clients | max batch | answered | req/s | mean batch "
        "| Redis CPU | Redis commands | gateway CPU | workers CPU | workers per stage run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        c = p.per_request()
        lines.append(
            f"| {p.round} | {p.pipeline} | {p.hops} | {p.load.clients} | "
            f"{p.load.max_batch} | {p.requests} | "
            f"{p.rps:.0f} | {p.batch:.1f} | {c['redis_cpu']:.0f} | {c['redis_cmd']:.0f} | "
            f"{c['gateway']:.0f} | {c['workers']:.0f} | {c['workers'] / p.hops:.0f} |"
        )
    lines += [
        "",
        "## Per hop",
        "",
        "Fixed and per-hop µs per request, fitted through the one- and three-hop chains, "
        "mean over rounds (range and half-spread in brackets); the check predicts "
        f"`capwiki` ({HOPS['capwiki']} stage runs) as fixed + {HOPS['capwiki']} x per hop. "
        f"Item-hops/s per shard: one Redis core at {100 * args.headroom:.0f}% busy over "
        "the per-hop Redis CPU (the marginal rate; each request also pays the fixed part).",
        "",
        "| clients | max batch | mean batch | cost | fixed | per hop | capwiki predicted | capwiki "
        "measured | item-hops/s per shard |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in loads:
        fits = _fits(points, n)
        batch = _mean(p.batch for p in _points(points, "cap3", n))
        wiki = _points(points, "capwiki", n)
        for key, label in KEYS.items():
            fixed = _mean(f[key][0] for f in fits)
            hop = [f[key][1] for f in fits]
            predicted = fixed + HOPS["capwiki"] * _mean(hop)
            measured = _mean(p.per_request()[key] for p in wiki)
            rate = f"{1e6 * args.headroom / _mean(hop):,.0f}" if key == "redis_cpu" else ""
            lines.append(
                f"| {n.clients} | {n.max_batch} | {batch:.1f} | {label} | {fixed:.0f} | "
                f"{_spread(hop)} | {predicted:.0f} | {measured:.0f} | {rate} |"
            )
    for n in loads:
        lines += ["", f"## By command, {n} (mean over rounds)", ""]
        lines += _by_command(points, n)
    lines += [
        "",
        f"## Sizing for {args.target:,.0f} requests/s",
        "",
        f"Every process held to {100 * args.headroom:.0f}% of a core (Redis runs commands on "
        "one thread: a shard is one core, whatever the machine has). From the measured "
        "pipeline, mean over rounds. Partitions: "
        f"{PARTITIONS_PER_SHARD} per shard, so shards can be added by moving whole "
        "partitions. Workers are echo workers (serving cost only): a model worker is sized "
        "by its model's time per batch, not by this.",
        "",
        "| pipeline | clients | max batch | mean batch | Redis CPU µs/request "
        "| requests/s per shard | shards | partitions | gateway processes "
        "| echo worker processes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("cap1", "capwiki"):
        for n in loads:
            chosen = _points(points, name, n)
            cost = {k: _mean(p.per_request()[k] for p in chosen) for k in KEYS}
            plan = size(cost, args.target, args.headroom)
            lines.append(
                f"| {NAMES[name]} | {n.clients} | {n.max_batch} | "
                f"{_mean(p.batch for p in chosen):.1f} | "
                f"{plan.redis_us:.0f} | {plan.per_shard:,.0f} | {plan.shards} | "
                f"{PARTITIONS_PER_SHARD * plan.shards} | {plan.gateways} | {plan.workers} |"
            )
    return "\n".join(lines) + "\n"


PARTITIONED = "Partitions on a Redis Cluster"
"""The title of the section ``--shards``/``--partitions`` write."""


def replace_section(text: str, title: str, body: str) -> str:
    """``text`` (markdown) with its ``## title`` section, up to the next ``## `` heading,
    replaced by ``body`` (which starts with that heading); appended where there is none."""
    lines = text.splitlines(keepends=True)
    heading = f"## {title}\n"
    if heading not in lines:
        return text.rstrip("\n") + "\n\n" + body if text.strip() else body
    begin = lines.index(heading)
    end = next((i for i in range(begin + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    after = "".join(lines[end:])
    return "".join(lines[:begin]) + body + ("\n" + after if after else "")


def _ratios(values: list[float], bases: list[float]) -> str:
    """The ratio of the means, and each round's in brackets (``-`` over nothing)."""
    each = ", ".join(f"{v / b:.2f}" if b else "-" for v, b in zip(values, bases, strict=True))
    whole = _mean(bases)
    return f"{_mean(values) / whole:.2f} ({each})" if whole else f"- ({each})"


def _by_command_per_hop(points: list[Point], load: Load, layouts: Sequence[Layout]) -> list[str]:
    """Rows of calls and top-level µs per item-hop by command, one column pair a layout."""
    per: dict[Layout, dict[str, tuple[float, float]]] = {}
    for layout in layouts:
        ones, threes = _points(points, "cap1", load, layout), _points(points, "cap3", load, layout)
        per[layout] = {}
        for name in {n for p in ones + threes for n in p.commands}:
            calls_one, one = _top_level(ones, name)
            calls_three, three = _top_level(threes, name)
            per[layout][name] = ((calls_three - calls_one) / 2, (three - one) / 2)
    names = sorted(
        {n for costs in per.values() for n in costs},
        key=lambda n: -max(abs(costs.get(n, (0.0, 0.0))[1]) for costs in per.values()),
    )
    rows = []
    for name in names:
        cells = [per[layout].get(name, (0.0, 0.0)) for layout in layouts]
        if max(abs(us) for _, us in cells) < 0.2:
            continue
        row = " | ".join(f"{calls:.2f} | {us:.1f}" for calls, us in cells)
        rows.append(f"| {name.upper()} | {row} |")
    return rows


def _top_level(points: list[Point], name: str) -> tuple[float, float]:
    """Calls per request of command ``name`` that clients sent, and their top-level µs
    (a script's inner calls are in its ``EVALSHA``), mean over ``points``."""
    kept = [
        (p.commands.get(name, Calls(0, 0)), 1 - p.scripted.get(name, 0.0), max(1, p.requests))
        for p in points
    ]
    return (
        _mean(c.calls * k / n for c, k, n in kept),
        _mean(c.usec * k / n for c, k, n in kept),
    )


def partitioned(
    points: list[Point],
    layouts: Sequence[Layout],
    command: str,
    took: float,
    load_avg: tuple[float, float],
) -> str:
    """The :data:`PARTITIONED` section: per item-hop Redis cost of each layout against
    one redis-server with one partition, the batches reached, each shard's share."""
    loads = list(dict.fromkeys(p.load for p in points))
    rounds = max(p.round for p in points)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"## {PARTITIONED}",
        "",
        f"Written by `{command}` on {stamp} in {took:.0f} s ({rounds} rounds, in each the "
        f"layouts in turn: {'; '.join(map(str, layouts))}; {'; '.join(map(str, loads))}); "
        "rerun it to refresh this section. Load average (1 min) "
        f"{load_avg[0]:.2f} at the start, {load_avg[1]:.2f} at the end.",
        "",
        "The one- and three-hop chains as above, each layout in the same run: on one "
        "redis-server with one partition, and on a loopback Redis Cluster "
        "(`conveyor.embedded.cluster`: masters only, AOF switched off to match the single "
        "server) with every process given `CONVEYOR_REDIS_URL=redis+cluster://...` and "
        "`CONVEYOR_PARTITIONS=P`. `CONFIG RESETSTAT`, `INFO commandstats`, `INFO cpu` and "
        "`MONITOR` on every node; Redis's cost is summed over the nodes, idle ones included "
        "(a cluster node's own upkeep is part of what a shard costs). Per item-hop: the "
        "per-hop part of the fit through the two chains. Ratio: this layout's mean over "
        "rounds over the single server's, each round's own ratio in brackets. Every "
        "process shares the machine's cores, so compare CPU per item, not requests/s.",
        "",
        "| clients | max batch | layout | mean batch, 3 hops | Redis CPU µs per item-hop "
        "| vs one server | Redis commands µs per item-hop | vs one server "
        "| Redis CPU µs per request, 1 hop | each node's share of Redis CPU (and of calls), "
        "3 hops |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in loads:
        base = _fits(points, n, SINGLE)
        for layout in layouts:
            fits, threes = _fits(points, n, layout), _points(points, "cap3", n, layout)
            cpu, cmd = [f["redis_cpu"][1] for f in fits], [f["redis_cmd"][1] for f in fits]
            ones = [p.per_request()["redis_cpu"] for p in _points(points, "cap1", n, layout)]
            cpu_by_node = [sum(col) for col in zip(*(p.shard_cpu_s for p in threes), strict=True)]
            calls = [sum(col) for col in zip(*(p.shard_calls for p in threes), strict=True)]
            lines.append(
                f"| {n.clients} | {n.max_batch} | {layout} | "
                f"{_mean(p.batch for p in threes):.1f} | {_spread(cpu)} | "
                f"{_ratios(cpu, [f['redis_cpu'][1] for f in base])} | {_spread(cmd)} | "
                f"{_ratios(cmd, [f['redis_cmd'][1] for f in base])} | {_spread(ones)} | "
                f"{_shares(cpu_by_node)} (calls {_shares(calls)}) |"
            )
    for n in loads:
        lines += [
            "",
            f"By command, {n}: calls and µs per item-hop that clients sent (the 3-hop chain "
            "less the 1-hop, halved; summed over nodes; a script's commands inside its "
            "`EVALSHA`), mean over rounds:",
            "",
            "| command | " + " | ".join(f"{layout} calls | µs" for layout in layouts) + " |",
            "|---|" + "---|---|" * len(layouts),
        ]
        lines += _by_command_per_hop(points, n, layouts)
    lines += [
        "",
        "Every measurement (µs per request; shares: each node's share of Redis CPU, and of "
        "the commands it ran):",
        "",
        "| round | layout | pipeline | clients | max batch | answered | req/s | mean batch "
        "| Redis CPU | Redis commands | gateway CPU | workers CPU | CPU shares | call shares |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        c = p.per_request()
        lines.append(
            f"| {p.round} | {p.layout} | {p.pipeline} | {p.load.clients} | "
            f"{p.load.max_batch} | {p.requests} | {p.rps:.0f} | {p.batch:.1f} | "
            f"{c['redis_cpu']:.0f} | {c['redis_cmd']:.0f} | {c['gateway']:.0f} | "
            f"{c['workers']:.0f} | {_shares(p.shard_cpu_s)} | {_shares(p.shard_calls)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Measure, fit, size, and write the report."""
    parser = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--loads",
        default="1x32,64x1,64x32,256x32",
        help="CLIENTSxMAX_BATCH, comma-separated",
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--target", type=float, default=200_000, help="requests/s to size for")
    parser.add_argument("--headroom", type=float, default=0.7, help="busy share of a core")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("CAPACITY.md"))
    parser.add_argument(
        "--shards",
        type=int,
        default=1,
        help="Redis masters: 1, one redis-server; 3 or more, a loopback Redis Cluster",
    )
    parser.add_argument(
        "--partitions",
        default="1",
        help="CONVEYOR_PARTITIONS, comma-separated; any but 1 on one server measures "
        "each against one partition on one redis-server and rewrites only the "
        f"'{PARTITIONED}' section of --out",
    )
    args = parser.parse_args(argv)
    if args.shards == 2 or args.shards < 1:
        parser.error("--shards: 1 (one redis-server) or 3 or more (a Redis Cluster)")
    layouts = [SINGLE] + [
        layout
        for layout in (Layout(int(p), args.shards) for p in args.partitions.split(","))
        if layout != SINGLE
    ]
    began, load_before = time.monotonic(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="conveyor-capacity-") as tmp:
        loads = [Load.parse(text) for text in args.loads.split(",")]
        names = tuple(HOPS) if len(layouts) == 1 else ("cap1", "cap3")
        points = run(args.rounds, loads, args.seconds, args.warmup, Path(tmp), layouts, names)
    took, load_avg = time.monotonic() - began, (load_before, os.getloadavg()[0])
    if len(layouts) == 1:
        args.out.write_text(markdown(points, args, took, load_avg))
    else:
        command = " ".join([COMMAND, *(argv if argv is not None else sys.argv[1:])])
        section = partitioned(points, layouts, command, took, load_avg)
        old = args.out.read_text() if args.out.exists() else ""
        args.out.write_text(replace_section(old, PARTITIONED, section))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
