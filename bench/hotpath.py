"""The hot path's cost: Redis's work and each process's round trips per request, and where
one request's time goes.

``python -m bench.hotpath`` starts conveyor as :mod:`bench.capacity` does (redis-server,
the gateway, one worker: :func:`bench.systems.conveyor`) for each of ``--workloads``
(``echo``, no model; ``embed``, MiniLM) and loads it through HTTP with the bench's closed
loop at each of ``--clients``. Each interval below is one whole closed loop after a warm-up
loop, so every request of it is counted and no other:

- **counted**: ``CONFIG RESETSTAT`` before it; ``INFO commandstats`` (calls and µs by
  command; Redis 7 counts a command a script runs under its own name too), ``INFO cpu``
  and ``INFO stats`` (socket reads) after; the gateway's and the worker's CPU (/proc);
  batches from the stage's stats hash.
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
import gzip
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import groupby
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import redis

from bench.capacity import (
    CONTAINERS,
    Calls,
    commandstats,
    replace_section,
    script_own_usec,
    scripted_shares,
    top_level_usec,
)
from bench.loadgen import LoadResult, closed_loop
from bench.systems import HOST, ConveyorServer, Options, conveyor, cpu_seconds
from bench.workloads import bodies, stage_of
from pipelines.keys import Keys

TITLE = "The hot path: Redis work and latency per request"
COMMAND = "HF_HUB_OFFLINE=1 .venv/bin/python -m bench.hotpath"
LUA = "lua"
"""The client ``MONITOR`` names for a command a script ran."""
PACKAGES = ("conveyor", "gateway", "workers", "runtime", "pipelines")
"""The product's code (whose uncommitted changes the report names)."""
PROCESSES = ("gateway", "worker", "other")
"""Who sends commands: conveyor's two processes, and any connection neither holds."""

SETTLE_S = 1.5
"""Idle time after a loop: a worker holds its batches' counts back (``stats_flush_s``)
and sends them once idle, after a read that waited ``block_ms`` (1 s) for nothing."""

_LINE = re.compile(rb'^\+(\d+\.\d+) \[\d+ ([^\]]+)\] "([^"]*)"(?: "((?:[^"\\]|\\.)*)")?')
_ENTRY_ID = re.compile(rb'\\"id\\":\\"([0-9A-Za-z_-]+)\\"')  # in an envelope's JSON
_DONE_KEY = re.compile(rb":done:([0-9A-Za-z_-]+):")  # a publish's marker, one per request
_CANCEL_KEY = re.compile(rb":cancelled:([0-9A-Za-z_-]+)")  # asked before the model runs


class Event(NamedTuple):
    """One ``MONITOR`` line: when Redis ran it (server clock, s), the client (``ip:port``
    or ``lua``), the command as commandstats names it, its first argument, and the
    request ids it names (an XADD's envelope, an EVALSHA's "done" markers, the keys any
    other command reads to ask whether a request was cancelled)."""

    at: float
    client: str
    command: str
    key: str
    ids: tuple[str, ...] = ()


def parse_line(line: bytes) -> Event | None:
    """The :class:`Event` of one ``MONITOR`` line; None for one that is no command."""
    found = _LINE.match(line)
    if found is None:
        return None
    at, client, name, first = found.groups()
    command = name.decode().lower()
    key = (first or b"").decode(errors="replace")
    if command in CONTAINERS and first is not None:
        command = f"{command}|{key.lower()}"
    ids: list[bytes] = []
    if command == "xadd":
        ids = _ENTRY_ID.findall(line)[:1]
    elif command in ("evalsha", "eval"):
        ids = _DONE_KEY.findall(line)
    else:
        ids = _CANCEL_KEY.findall(line)
    return Event(float(at), client.decode(), command, key, tuple(i.decode() for i in ids))


def round_trips(events: Iterable[Event], gap_s: float) -> list[tuple[str, list[str]]]:
    """``events`` (in ``MONITOR`` order) as round trips, (client, commands): a connection's
    command joins its last round trip if it came within ``gap_s`` and no other connection's
    came between (a script's commands belong to its call). Redis runs a pipeline's or a
    MULTI/EXEC's commands back to back; a second round trip waits for the client to read
    the reply and write again, which takes longer, or lets other clients' commands run."""
    trips: list[tuple[str, list[str]]] = []
    last_at = 0.0
    for e in events:
        if e.client == LUA:
            continue
        if trips and trips[-1][0] == e.client and e.at - last_at <= gap_s:
            trips[-1][1].append(e.command)
        else:
            trips.append((e.client, [e.command]))
        last_at = e.at
    return trips


def shape(commands: Sequence[str]) -> str:
    """A round trip as the tables name it, whatever its size: ``n SET + n GET`` (a run of
    several), ``XADD`` (one), ``MULTI/EXEC: XLEN, HMGET``."""
    runs = [("n " if len(list(run)) > 1 else "") + name.upper() for name, run in groupby(commands)]
    if len(runs) > 2 and commands[0] == "multi" and commands[-1] == "exec":
        return "MULTI/EXEC: " + ", ".join(runs[1:-1])
    return " + ".join(runs)


def socket_ports(tcp: str) -> dict[int, int]:
    """Local port by socket inode, from the text of ``/proc/net/tcp``."""
    out = {}
    for line in tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9:
            out[int(fields[9])] = int(fields[1].rsplit(":", 1)[1], 16)
    return out


def client_roles(roles: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """``ip:port`` of every TCP socket the processes of each role hold, to its role."""
    ports = socket_ports(Path("/proc/net/tcp").read_text())
    out = {}
    for role, pids in roles.items():
        for pid in pids:
            try:
                links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
            except OSError:
                continue  # gone
            for link in links:
                if link.startswith("socket:[") and (inode := int(link[8:-1])) in ports:
                    out[f"{HOST}:{ports[inode]}"] = role
    return out


@dataclass
class Watched:
    """One load under ``MONITOR``, by process (role): commands, round trips by
    :func:`shape` and the commands in them, connections; and the requests (entries the
    gateway wrote to a stage), the batches (script calls that publish requests), and per command
    the share of its calls scripts ran."""

    requests: int
    batches: int
    commands: Counter[tuple[str, str]] = field(default_factory=Counter)
    trips: Counter[tuple[str, str]] = field(default_factory=Counter)
    trip_commands: Counter[tuple[str, str]] = field(default_factory=Counter)
    connections: Counter[str] = field(default_factory=Counter)
    scripted: dict[str, float] = field(default_factory=dict)

    def per_request(self, role: str) -> float:
        """Round trips per request of one process (``all``: every process)."""
        chosen = PROCESSES if role == "all" else (role,)
        return sum(n for (r, _), n in self.trips.items() if r in chosen) / max(1, self.requests)


def tally(events: Sequence[Event], roles: Mapping[str, str], gap_s: float) -> Watched:
    """What :class:`Watched` holds, from the events of one interval and each client's role
    (a client without one is ``other``; a script's commands are ``in scripts``)."""
    role = {e.client: roles.get(e.client, "other") for e in events}
    role[LUA] = "in scripts"
    entries = (e for e in events if e.command == "xadd" and role[e.client] != role[LUA])
    out = Watched(
        requests=sum(1 for e in entries if ":stage:" in e.key),
        batches=sum(1 for e in events if e.command == "evalsha" and e.ids),
    )
    for e in events:
        out.commands[role[e.client], e.command] += 1
    for client, commands in round_trips(events, gap_s):
        out.trips[role[client], shape(commands)] += 1
        out.trip_commands[role[client], shape(commands)] += len(commands)
    out.connections.update(role[c] for c in {e.client for e in events} if c != LUA)
    out.scripted = scripted_shares(Counter((e.command, e.client == LUA) for e in events))
    return out


class Monitor:
    """``MONITOR`` on a Redis, its output kept raw (a thread reads it) until stopped."""

    def __init__(self, port: int) -> None:
        self._sock = socket.create_connection((HOST, port), timeout=10)
        self._sock.sendall(b"MONITOR\r\n")
        first = b""
        while b"\r\n" not in first:  # watching from here on: nothing before counts
            if not (chunk := self._sock.recv(1 << 16)):
                raise ConnectionError("Redis closed the connection to MONITOR")
            first += chunk
        answer, _, rest = first.partition(b"\r\n")
        if answer != b"+OK":
            raise ConnectionError(f"MONITOR answered {answer!r}")
        self._chunks = [rest]
        self._sock.settimeout(0.1)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._done.is_set():
            try:
                chunk = self._sock.recv(1 << 20)
            except TimeoutError:
                continue  # nothing ran: look at the flag again
            if not chunk:
                return
            self._chunks.append(chunk)

    def stop(self) -> list[Event]:
        """Stop watching; every command seen, in order."""
        time.sleep(0.05)  # the last lines are on their way
        self._done.set()
        self._thread.join()
        self._sock.close()
        lines = b"".join(self._chunks).split(b"\r\n")
        return [e for line in lines if (e := parse_line(line)) is not None]


class Span(NamedTuple):
    """One received span, times in seconds since the epoch."""

    service: str
    name: str
    trace_id: str
    parent_id: str
    start: float
    end: float
    attributes: dict[str, Any]


@contextmanager
def receiver() -> Iterator[tuple[str, list[bytes]]]:
    """An OTLP/HTTP trace endpoint on loopback and the export requests it has received,
    kept as sent: :func:`decode` reads them afterwards, off the measured path."""
    got: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            gzipped = self.headers.get("Content-Encoding") == "gzip"
            got.append(gzip.decompress(body) if gzipped else body)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            del format, args

    server = ThreadingHTTPServer((HOST, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://{HOST}:{server.server_address[1]}", got
    finally:
        server.shutdown()
        server.server_close()


def decode(exports: Iterable[bytes]) -> list[Span]:
    """The spans of OTLP/HTTP export requests (``ExportTraceServiceRequest``)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    def value(v: Any) -> Any:
        kind = v.WhichOneof("value")
        return getattr(v, kind) if kind else None

    out = []
    for body in exports:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for rs in request.resource_spans:
            service = {a.key: value(a.value) for a in rs.resource.attributes}["service.name"]
            out += [
                Span(
                    *(str(service), s.name, s.trace_id.hex(), s.parent_span_id.hex()),
                    *(s.start_time_unix_nano / 1e9, s.end_time_unix_nano / 1e9),
                    {a.key: value(a.value) for a in s.attributes},
                )
                for scope in rs.scope_spans
                for s in scope.spans
            ]
    return out


STEPS = (
    ("parse", "HTTP request read, headers and body validated: root span start → admission"),
    ("admission", "the `admission` span"),
    ("enqueue", "admitted → its XADD runs in Redis"),
    (
        "wait for the worker's read, and the window",
        "XADD → the batch closed (`batch` span's start); at one client the adaptive window "
        "closes on the read that brought the entry",
    ),
    ("claim and cancel check", "closed → its cancel check (with the claim) runs in Redis"),
    ("to the model", "check → the model starts (its answer read, the hand-off to the thread)"),
    ("model", "the `run` span"),
    ("publish", "model done → the batch's EVALSHA runs in Redis"),
    ("reply read", "EVALSHA → the handler has the reply (`reply` span's end)"),
    ("answer", "the response written: `reply` end → root span end"),
)
"""The pieces a traced request's time is cut into, each with its two edges."""


def server_times(events: Iterable[Event]) -> dict[str, dict[str, float]]:
    """Per request id, when Redis first ran its XADD to a stage (``xadd``), its batch's
    cancel check (``check``: the worker asks before the model runs) and its batch's
    script call (``script``)."""
    out: dict[str, dict[str, float]] = {"xadd": {}, "check": {}, "script": {}}
    for e in events:
        if e.client == LUA or (e.command == "xadd" and ":stage:" not in e.key):
            continue  # a script's, or a reply
        which = {"xadd": "xadd", "evalsha": "script", "eval": "script"}.get(e.command, "check")
        for rid in e.ids:
            out[which].setdefault(rid, e.at)
    return out


def breakdown(
    spans: Iterable[Span], stage: str, times: Mapping[str, Mapping[str, float]]
) -> dict[str, list[float]]:
    """Each :data:`STEPS` piece of every complete traced request, in ms, from its gateway
    spans (root, ``admission``, ``reply``), its stage's ``batch`` and ``run`` spans and its
    :func:`server_times`; and ``total``, its root span. A request missing any is left out."""
    traces: dict[str, dict[str, Span]] = defaultdict(dict)
    for s in spans:
        name = "root" if s.service.endswith("gateway") and not s.parent_id else s.name
        if name == f"{stage} batch" and "conveyor.request_id" not in s.attributes:
            continue  # the batch's own span, in a trace of its own
        traces[s.trace_id][name] = s
    out: dict[str, list[float]] = {name: [] for name, _ in STEPS}
    out["total"] = []
    for t in traces.values():
        try:
            root, admission, reply = t["root"], t["admission"], t["reply"]
            batch, run = t[f"{stage} batch"], t[f"{stage} run"]
            rid = str(batch.attributes["conveyor.request_id"])
            edges = [root.start, admission.start, admission.end, times["xadd"][rid]]
            edges += [batch.start, times["check"][rid], run.start, run.end]
            edges += [times["script"][rid], reply.end, root.end]
        except KeyError:
            continue
        for (name, _), begin, end in zip(STEPS, edges, edges[1:], strict=False):
            out[name].append(1000 * (end - begin))
        out["total"].append(1000 * (root.end - root.start))
    return out


@dataclass
class Counted:
    """One load, counted.

    Attributes:
        clients: clients of the closed loop.
        result: the closed loop's outcome.
        items: items the stage ran (its stats hash).
        batches: batches it ran them in.
        commands: ``INFO commandstats`` over the loop.
        redis_cpu_s: redis-server's CPU seconds (``INFO cpu``, user + sys).
        reads: socket reads Redis made (``INFO stats`` ``total_reads_processed``): one per
            round trip of any client (more for one over 16 KiB).
        gateway_cpu_s: the gateway's CPU seconds.
        worker_cpu_s: the worker's.
    """

    clients: int
    result: LoadResult
    items: float
    batches: float
    commands: dict[str, Calls]
    redis_cpu_s: float
    reads: int
    gateway_cpu_s: float
    worker_cpu_s: float

    @property
    def requests(self) -> int:
        """Requests answered 200 (at least 1: a divisor)."""
        return max(1, self.result.statuses.get(200, 0))


def _redis_cpu(client: redis.Redis) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


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
            start["redis"] = _redis_cpu(r)

        result = _loop(server, workload, clients, 20_000, seconds, reset)
        commands = commandstats(r.info("commandstats"))
        redis_cpu = _redis_cpu(r) - start["redis"]
        reads = int(r.info("stats")["total_reads_processed"])
        items, batches = (a - b for a, b in zip(_stage_totals(r, stage), start["ran"], strict=True))
    commands.pop("info", None)  # this bench's own reads
    gateway, worker = (cpu_seconds(p) - start["cpu"][role] for role, p in pids.items())
    return Counted(clients, result, items, batches, commands, redis_cpu, reads, gateway, worker)


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


@dataclass
class Measured:
    """Everything measured of one workload: per load counted and watched; traced."""

    counted: list[Counted]
    watched: list[Watched]
    pieces: dict[str, list[float]]
    traced: LoadResult


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


def _f(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if x else ""


def command_rows(c: Counted, w: Watched) -> list[str]:
    """Per command: calls per request and per batch (counted), per request by who sent it
    (watched), µs per request (counted); most calls first; then the whole."""
    n, b, wn = c.requests, max(1.0, c.batches), max(1, w.requests)
    rows = []
    for name, calls in sorted(c.commands.items(), key=lambda kv: (-kv[1].calls, kv[0])):
        by = [w.commands[role, name] / wn for role in ("gateway", "worker", "in scripts")]
        rows.append(
            f"| {name.upper()} | {calls.calls / n:.2f} | {calls.calls / b:.2f} | "
            f"{' | '.join(_f(x) for x in by)} | {calls.usec / n:.1f} |"
        )
    total = sum(x.calls for x in c.commands.values())
    sent = total - sum(x.calls * w.scripted.get(k, 0.0) for k, x in c.commands.items())
    return [
        *rows,
        f"| **all** ({sent / n:.2f} sent by clients) | **{total / n:.2f}** | "
        f"**{total / b:.1f}** | | | | **{sum(x.usec for x in c.commands.values()) / n:.1f}** |",
    ]


def section(
    measured: Mapping[str, Measured],
    args: argparse.Namespace,
    machine: Sequence[str],
    code: str,
    took: float,
    load_avg: tuple[float, float],
) -> str:
    """The :data:`TITLE` section of ``RESULTS.md``."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join([COMMAND, *args.argv])
    lines = [
        f"## {TITLE}",
        "",
        f"Written by `{command}` on {stamp} in {took:.0f} s; load average (1 min) "
        f"{load_avg[0]:.2f} at the start, {load_avg[1]:.2f} at the end. Rerun it to refresh "
        "this section (a full `python -m bench` rewrites the whole file).",
        "",
        *machine,
        code,
        "- Redis, the gateway, the worker and the load generator share these cores with "
        "whatever else runs here: times are noisy, compare ratios within one run. Counts "
        "(commands, round trips) do not depend on the machine, except where they follow the "
        "batch size or the clock (background reads per request fall as requests/s rise).",
        "",
        "conveyor as `bench.capacity` starts it (redis-server, the gateway, one worker, "
        "batches of up to 32), loaded through HTTP by the bench's closed loop. Every interval "
        f"is one whole closed loop after a 1 s warm-up loop, with {SETTLE_S:g} s idle before "
        "and after it (what a worker holds back goes out when it idles). **Counted** (no "
        f"`MONITOR`; up to {args.seconds:g} s): `CONFIG RESETSTAT` before; `INFO "
        "commandstats`, `INFO cpu` and `INFO stats` after; gateway and worker CPU from /proc; "
        "batches from the stage's stats hash. Redis 7 counts a command a script runs under "
        "its own name as well as in `EVALSHA`: the calls include them, and their µs are "
        "inside `EVALSHA`'s too. "
        f"**Watched** (up to {args.watch_seconds:g} s under `MONITOR`): every client "
        "connection given to its process through /proc. **Round trips are approximate:** "
        f"a connection's commands that reach Redis within {args.gap_ms:g} ms of each other "
        "with no other connection's command between count as one round trip (a pipeline or "
        "a MULTI/EXEC runs that way; two round trips in a row would need the client to read "
        "the reply and write again that fast while nothing else ran). Redis's own count of "
        "socket reads (counted interval) is the check on their sum.",
    ]
    for workload, m in measured.items():
        pairs = list(zip(m.counted, m.watched, strict=True))
        lines += [
            "",
            f"### {workload}: per request",
            "",
            "| clients | requests | req/s | p50 ms | p99 ms | mean batch | Redis commands "
            "| Redis CPU µs | command µs, top level | of which scripts' own | gateway CPU µs "
            "| worker CPU µs |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c, w in pairs:
            n = c.requests
            lines.append(
                f"| {c.clients} | {n} | {c.result.throughput:.0f} | {c.result.pct(0.5):.2f} | "
                f"{c.result.pct(0.99):.2f} | {c.items / max(1.0, c.batches):.1f} | "
                f"{sum(x.calls for x in c.commands.values()) / n:.2f} | "
                f"{1e6 * c.redis_cpu_s / n:.0f} | "
                f"{top_level_usec(c.commands, w.scripted) / n:.1f} | "
                f"{script_own_usec(c.commands, w.scripted) / n:.1f} | "
                f"{1e6 * c.gateway_cpu_s / n:.0f} | {1e6 * c.worker_cpu_s / n:.0f} |"
            )
        for c, w in pairs:
            lines += [
                "",
                f"### {workload}, {c.clients} client{'s' * (c.clients > 1)}: Redis commands "
                f"by name (per request; who sent them from the watched interval: "
                f"{w.requests} requests, {w.batches} batches)",
                "",
                "| command | calls/request | calls/batch | gateway | worker | in scripts "
                "| µs/request |",
                "|---|---|---|---|---|---|---|",
                *command_rows(c, w),
            ]
        lines += [
            "",
            f"### {workload}: round trips to Redis per request, by process",
            "",
            "| clients | process | connections | round trips/request | round trips/batch "
            "| commands/round trip |",
            "|---|---|---|---|---|---|",
        ]
        for c, w in pairs:
            for role in (*PROCESSES, "all"):
                chosen = PROCESSES if role == "all" else (role,)
                trips = sum(n for (r, _), n in w.trips.items() if r in chosen)
                sent = sum(n for (r, _), n in w.commands.items() if r in chosen)
                if trips:
                    lines.append(
                        f"| {c.clients} | {role} | {sum(w.connections[r] for r in chosen)} | "
                        f"{trips / max(1, w.requests):.2f} | {trips / max(1, w.batches):.2f} | "
                        f"{sent / trips:.2f} |"
                    )
            lines.append(
                f"| {c.clients} | all: Redis's socket reads (counted) | | "
                f"{c.reads / c.requests:.2f} | {c.reads / max(1.0, c.batches):.2f} | |"
            )
        lines += [
            "",
            f"### {workload}: what the round trips are (watched; n: several of one command)",
            "",
            "| clients | process | round trip | per request | commands in each (mean) |",
            "|---|---|---|---|---|",
        ]
        for c, w in pairs:
            for (role, name), n in sorted(w.trips.items(), key=lambda kv: (kv[0][0], -kv[1])):
                if n / max(1, w.requests) >= 0.005:
                    lines.append(
                        f"| {c.clients} | {role} | {name} | {n / max(1, w.requests):.3f} | "
                        f"{w.trip_commands[role, name] / n:.1f} |"
                    )
        medians = {k: statistics.median(v) if v else float("nan") for k, v in m.pieces.items()}
        whole = sum(medians[name] for name, _ in STEPS)
        untraced = [c.result.pct(0.5) for c in m.counted if c.clients == 1]
        lines += [
            "",
            f"### {workload}: where one request's time goes, 1 client (median of "
            f"{len(m.pieces['total'])} traced requests)",
            "",
            "Cut at the edges of the spans conveyor exports (`runtime/tracing.py`, "
            "`workers/spans.py`, `gateway/traces.py`; FastAPI's root span) and at the times "
            "Redis ran the request's commands (`MONITOR`); conveyor's spans are on the Redis "
            "clock, the root span on the gateway's (one machine: they agree to within a "
            "loopback round trip). Tracing and `MONITOR` add work to every step: compare the "
            "traced and untraced latency below, and read the shares.",
            "",
            "| step | from → to | median ms | share of the sum |",
            "|---|---|---|---|",
            *(
                f"| {name} | {edges} | {medians[name]:.2f} | {100 * medians[name] / whole:.0f}% |"
                for name, edges in STEPS
            ),
            f"| sum of the medians | | {whole:.2f} | |",
            f"| the root span (median) | | {medians['total']:.2f} | |",
            f"| at the client, traced (p50) | | {m.traced.pct(0.5):.2f} | |",
            f"| at the client, untraced (p50, counted) | | "
            f"{untraced[0] if untraced else float('nan'):.2f} | |",
        ]
    return "\n".join(lines) + "\n"


def tree() -> str:
    """Which code runs: the checkout's commit and its uncommitted product files."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        return done.stdout.rstrip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return f"- Code: {root} (not a git checkout)"
    changed = git("status", "--porcelain", "--", *PACKAGES).splitlines()
    names = ", ".join(line[3:] for line in changed[:12]) + (", ..." if len(changed) > 12 else "")
    return f"- Code: commit {head}" + (
        f", with uncommitted changes to {len(changed)} files ({names})" if changed else ""
    )


def place_section(text: str, title: str, body: str, before: str = "What runs") -> str:
    """``text`` with its ``## title`` section replaced by ``body``; where it has none,
    ``body`` goes before the ``## before`` section (else at the end)."""
    anchor = f"## {before}\n"
    if f"## {title}\n" in text.splitlines(keepends=True) or anchor not in text:
        return replace_section(text, title, body)
    head, _, tail = text.partition(anchor)
    return head + body + "\n" + anchor + tail


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
    print(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
