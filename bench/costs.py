"""``python -m bench.costs``: what the hot path's parts cost, each measured alone.

Starts a redis-server of its own on a free loopback port and measures, in this process:

- ``pool``: CPU per connection taken and given back, and per ``PING`` round trip, through
  redis-py's ``BlockingConnectionPool`` and through conveyor's :class:`runtime.pool.Pool`
  (the same pool with a short way for a free connection), alternating.
- ``script``: what a publish's per-request writes cost inside a Lua script, by Redis's own
  ``INFO commandstats`` (µs per ``EVALSHA``): ``n`` done markers as ``SET .. EX`` each
  (the publish's; new keys every call, as a publish's are) against one ``HSET`` of ``n``
  fields and an ``EXPIRE`` in a new hash (what markers per batch would cost), and ``n``
  replies as one ``XADD`` each (the publish's before 97f0709) against one ``XADD`` of
  ``n`` fields (since: a batch's replies to a gateway are one entry).
- ``worker``: one worker alone (no gateway, no HTTP) draining ``--requests`` echo requests
  already in its stream, in burst mode, at each of ``--batches``: its CPU per batch and
  per request, Redis's commands and command µs per request (``INFO commandstats``, reset
  before), and Redis's socket reads per batch (its round trips).
- ``sending``: on uvloop (as conveyor's processes run), CPU and wall time per ``PING`` and
  per two-command pipeline (the worker's claim), and the same worker at each of
  ``--batches``, with conveyor's connections writing a command directly
  (:mod:`runtime.packing`) against redis-py's ``asyncio.wait_for`` (a task per write on
  Python 3.11), alternating for ``--rounds``. Both take their connections from
  conveyor's pool, whose release takes no task either way (:mod:`runtime.pool`).
- ``packing``: CPU per command packed, redis-py's own (Python) packer against conveyor's
  (hiredis, :func:`runtime.packing.packing`), for a publish's ``EVALSHA`` of a batch of
  16 (its shape: markers, cancellation keys, the plan, a reply each; ~70 arguments) and
  a gateway's ``XADD``; then the same worker at each of ``--batches`` with its
  connections packing either way, alternating for ``--rounds``.

CPU is this process's (``time.process_time``), so the machine's other work matters less
than to wall times; still compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection, Connection

from bench.workloads import stage_request
from conveyor.embedded import free_port, start_redis
from pipelines.keys import Keys
from pipelines.settings import CommonSettings
from pipelines.stages import Stage, TextIn
from runtime.packing import packing
from runtime.pool import Pool
from runtime.redisio import connect, enqueue
from workers.loop import Worker
from workers.models.toy import Echo
from workers.settings import WorkerSettings

REPLY = b'{"v":1,"id":"0123456789abcdef0123456789abcdef","outcome":"ok","result":{"text":"hi"}}'
"""A small reply, as an echo request's."""


async def _cpu_us(n: int, step: Callable[[], Awaitable[Any]]) -> float:
    started = time.process_time()
    for _ in range(n):
        await step()
    return (time.process_time() - started) / n * 1e6


async def pool_costs(url: str, rounds: int) -> list[str]:
    """CPU per get + release and per PING, redis-py's pool against conveyor's."""
    lines = ["| pool | get + release, µs CPU | PING round trip, µs CPU |", "|---|---:|---:|"]
    for _ in range(rounds):
        for cls in (aioredis.BlockingConnectionPool, Pool):
            pool = cls.from_url(url, max_connections=64, timeout=5)
            client = aioredis.Redis.from_pool(pool)
            await client.ping()

            async def take(pool: aioredis.BlockingConnectionPool = pool) -> None:
                conn = await pool.get_connection()  # type: ignore[no-untyped-call]
                await pool.release(conn)

            taken = await _cpu_us(20_000, take)
            ping = await _cpu_us(2_000, client.ping)
            await client.aclose()
            lines.append(f"| {cls.__module__}.{cls.__name__} | {taken:.1f} | {ping:.1f} |")
    return lines


SCRIPTS = {
    "n SET .. EX (a marker each)": (
        "for i = 1, #KEYS do redis.call('SET', KEYS[i], '1', 'EX', 60) end return 1"
    ),
    "one HSET of n fields + EXPIRE": (
        "local f = {} for i = 1, #KEYS do f[#f + 1] = KEYS[i] f[#f + 1] = '1' end "
        "local h = KEYS[1] .. ':batch' "
        "redis.call('HSET', h, unpack(f)) redis.call('EXPIRE', h, 60) return 1"
    ),
    "n XADD (a reply each)": (
        "for i = 1, #ARGV do redis.call('XADD', 'bench:r1', 'MAXLEN', '~', 1000, '*', 'e', "
        "ARGV[i]) end return 1"
    ),
    "one XADD of n fields": (
        "local f = {} for i = 1, #ARGV do f[#f + 1] = i f[#f + 1] = ARGV[i] end "
        "redis.call('XADD', 'bench:r2', 'MAXLEN', '~', 1000, '*', unpack(f)) return 1"
    ),
    "nothing (the call alone)": "return 1",
}


def script_costs(port: int, n: int, calls: int) -> list[str]:
    """µs per EVALSHA of each script of :data:`SCRIPTS` on a batch of ``n``.

    Every call names ``n`` keys never written before, shaped as a done marker's (a
    namespace, a request id, a step), as a publish's markers are: a new key costs Redis
    more than one written again (5.4-7.2 µs against 2.8-4.0 a ``SET .. EX`` in a loop of
    16, 2026-11-29), so markers written again would understate the per-request cost."""
    client = redis.Redis(port=port)
    lines = [f"| a batch of {n}: script | µs per call | µs per request |", "|---|---:|---:|"]
    for name, source in SCRIPTS.items():
        sha = client.script_load(source)
        batches = [
            [f"{{bench}}:done:{uuid.uuid4().hex}:echo" for _ in range(n)] for _ in range(calls)
        ]
        client.config_resetstat()
        for keys in batches:
            client.evalsha(sha, n, *keys, *([REPLY] * n))
        us = float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])
        lines.append(f"| {name} | {us:.1f} | {us / n:.2f} |")
    client.close()
    return lines


WORKER_HEADER = (
    "| batch | batches | worker CPU ms/batch | µs/request | Redis commands/request "
    "| command µs/request | socket reads/batch |"
)
"""The columns of a drain's row (:func:`worker_costs`)."""


async def worker_costs(url: str, requests: int, batch: int) -> str:
    """One worker draining ``requests`` echo requests in batches of ``batch``: a row of
    :data:`WORKER_HEADER`."""
    return _row(await _drain(url, requests, batch))


@dataclass
class Drained:
    """What one worker cost draining its stream (:func:`_drain`).

    Attributes:
        batch: the stage's max batch size.
        batches: model calls it made.
        requests: requests it drained.
        cpu_s: this process's CPU seconds meanwhile.
        calls: Redis commands run meanwhile (``INFO commandstats``).
        usec: their µs.
        reads: Redis's socket reads meanwhile (round trips).
    """

    batch: int
    batches: int
    requests: int
    cpu_s: float
    calls: int
    usec: int
    reads: int


def _row(d: Drained) -> str:
    return (
        f"| {d.batch} | {d.batches} | {1e3 * d.cpu_s / d.batches:.2f} | "
        f"{1e6 * d.cpu_s / d.requests:.0f} | {d.calls / d.requests:.2f} | "
        f"{d.usec / d.requests:.1f} | {d.reads / d.batches:.2f} |"
    )


async def _drain(url: str, requests: int, batch: int) -> Drained:
    """One worker draining ``requests`` echo requests, put in its stream first, in
    batches of ``batch`` (burst mode), on a namespace of its own on ``url``."""
    namespace = f"costs{batch}-{uuid.uuid4().hex[:8]}"  # a fresh stream each run
    keys = Keys(namespace)
    stage = Stage("echo", TextIn, Echo, batch_wait_ms=0, max_batch_size=batch)
    settings = WorkerSettings(redis_url=url, namespace=namespace, block_ms=50)
    worker = Worker(stage, settings, Echo())
    await worker.start()
    await worker.parts.source.ensure_stream()
    client = aioredis.Redis.from_url(url)
    pipe = client.pipeline(transaction=False)
    deadline = time.time() + 600
    for i in range(requests):
        enqueue(pipe, keys, stage_request(keys, "echo", f"hello {i}", deadline))
    await pipe.execute()
    await client.config_resetstat()
    started = time.process_time()
    batches = await worker.run(burst=True)
    cpu = time.process_time() - started
    stats = await client.info("commandstats")
    reads = (await client.info("stats"))["total_reads_processed"]
    await worker.close()
    await client.aclose()
    counted = {k: v for k, v in stats.items() if k != "cmdstat_config|resetstat"}
    calls = sum(v["calls"] for k, v in counted.items() if k != "cmdstat_info")
    usec = sum(v["usec"] for k, v in counted.items() if k != "cmdstat_info")
    return Drained(batch, batches, requests, cpu, calls, usec, reads)


PACKERS = {False: "redis-py (Python)", True: "hiredis (conveyor)"}
"""The two packers :func:`packing_costs` compares, by whether it is hiredis."""


@contextlib.contextmanager
def _packer(hiredis: bool) -> Iterator[None]:
    """Clients :func:`runtime.redisio.connect` makes within pack as conveyor's do
    (hiredis), or with redis-py's packer (the class ``connect`` would hand to
    :func:`runtime.packing.packing` is kept as it is)."""
    if hiredis:
        yield
        return
    with mock.patch("runtime.redisio.packing", lambda connection_class: connection_class):
        yield


_EMBEDDING = b'{"v":1,"outcome":"ok","result":{"embedding":[' + b"0.0123456789," * 600 + b"0]}}"
"""A reply of a MiniLM-sized embedding (~7.6 KB)."""

PACKED: dict[str, tuple[str | bytes | int, ...]] = {
    "a publish's EVALSHA, a batch of 16": (
        "EVALSHA",
        "0" * 40,
        50,
        *(f"{{conveyor}}:done:{i:032x}" for i in range(48)),
        "{conveyor}:stats:echo",
        "{conveyor}:replies:0",
        b'{"t":"","r":0,"tt":600,"m":32,"g":[["R",16,-1,1,600,-17,1,"ok",-50,2,1]]}',
        *([REPLY] * 16),
    ),
    "a gateway's XADD": (
        "XADD",
        "{conveyor}:stage:echo",
        "MAXLEN",
        "~",
        100_000,
        "*",
        "e",
        b'{"v":1,"id":"0123456789abcdef0123456789abcdef","pipeline":"echo","payload":{}}',
        "c",
        4,
    ),
    "a publish's EVALSHA, 32 embeddings (past LARGE: redis-py's packer)": (
        "EVALSHA",
        "0" * 40,
        98,
        *(f"{{conveyor}}:done:{i:032x}" for i in range(96)),
        "{conveyor}:stats:embed",
        "{conveyor}:replies:0",
        b"{}",
        *([_EMBEDDING] * 32),
    ),
    "a gateway's XADD of a 1 MB body (past LARGE)": (
        "XADD",
        "{conveyor}:stage:echo",
        "*",
        "e",
        b"x" * 1_000_000,
    ),
}
"""Commands shaped as conveyor's hot path sends them, for the packers to pack; the last
two hold more than :data:`runtime.packing.LARGE`, which conveyor's packer leaves to
redis-py's."""


async def packing_costs(url: str, requests: int, batches: list[int], rounds: int) -> list[str]:
    """CPU per command of :data:`PACKED` with each packer; then :func:`_drain` with
    redis-py's packer against hiredis, alternating.

    Args:
        url: the Redis to drain on.
        requests: echo requests each drain takes.
        batches: the batch sizes drained, each in turn.
        rounds: how many times each pair of drains runs.
    """
    ours, theirs = packing(Connection)(), Connection()
    lines = ["| command | args | redis-py's packer, µs | hiredis, µs |", "|---|---:|---:|---:|"]
    for name, args in PACKED.items():
        assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))
        times = []
        for conn in (theirs, ours):
            started = time.process_time()
            for _ in range(2000):
                conn.pack_command(*args)
            times.append((time.process_time() - started) / 2000 * 1e6)
        lines.append(f"| {name} | {len(args)} | {times[0]:.1f} | {times[1]:.1f} |")
    lines.append("")
    return lines + await _drains(url, requests, batches, rounds, _packer, "packer", PACKERS)


async def _drains(
    url: str,
    requests: int,
    batches: list[int],
    rounds: int,
    way: Callable[[bool], contextlib.AbstractContextManager[None]],
    what: str,
    names: dict[bool, str],
) -> list[str]:
    """:func:`_drain` at each of ``batches``, the old way (``way(False)``) and the new
    (``way(True)``), alternating ``rounds`` times: a row each, then each batch's medians
    and their ratio (``what`` heads the first column, ``names`` name the ways)."""
    lines = [f"| {what} {WORKER_HEADER}", "|---|" + "---:|" * 7]
    cpu: dict[tuple[int, bool], list[float]] = {}
    for _ in range(rounds):
        for batch in batches:
            for new in (False, True):
                with way(new):
                    drained = await _drain(url, requests, batch)
                cpu.setdefault((batch, new), []).append(drained.cpu_s / drained.batches)
                lines.append(f"| {names[new]} {_row(drained)}")
    lines += [
        "",
        f"| batch | worker CPU ms/batch, {names[False]} (median; rounds) | {names[True]} | ratio |",
        "|---:|---|---|---:|",
    ]
    for batch in batches:
        slow, fast = cpu[batch, False], cpu[batch, True]
        shown = [
            f"**{1e3 * statistics.median(v):.2f}** ({', '.join(f'{1e3 * x:.2f}' for x in v)})"
            for v in (slow, fast)
        ]
        ratio = statistics.median(fast) / statistics.median(slow)
        lines.append(f"| {batch} | {shown[0]} | {shown[1]} | {ratio:.2f}x |")
    return lines


class _WaitForSend(packing(Connection)):  # type: ignore[misc]
    """Conveyor's connection, but writing as redis-py does (``asyncio.wait_for``)."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        await AbstractConnection.send_packed_command(self, command, check_health)


def _uvloop_run() -> Callable[[Coroutine[Any, Any, list[str]]], list[str]]:
    """``uvloop.run`` where uvloop is installed (conveyor's processes run on it), else
    ``asyncio.run``."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


SENDERS = {False: "redis-py's wait_for", True: "direct (conveyor)"}
"""The two ways :func:`sending_costs` compares, by whether the write is direct."""


@contextlib.contextmanager
def _sender(direct: bool) -> Iterator[None]:
    """Clients :func:`runtime.redisio.connect` makes within write directly (conveyor's
    way) or through redis-py's ``wait_for``."""
    if direct:
        yield
        return
    with mock.patch("runtime.redisio.packing", return_value=_WaitForSend):
        yield


async def sending_costs(url: str, requests: int, batches: list[int], rounds: int) -> list[str]:
    """Per ``PING`` and per two-command pipeline (µs of CPU, µs of wall), then
    :func:`_drain`, each way of :data:`SENDERS`, alternating (``rounds`` times)."""
    settings = CommonSettings(redis_url=url)
    lines = [
        "| write | PING: µs CPU | µs wall | pipeline of 2: µs CPU | µs wall |",
        "|---|---:|---:|---:|---:|",
    ]
    for _ in range(rounds):
        for direct in (False, True):
            with _sender(direct):
                client = connect(settings)

            async def claim(client: aioredis.Redis = client) -> None:
                pipe = client.pipeline(transaction=False)
                pipe.hset("bench:marks", mapping={"a": "1", "b": "2"})
                pipe.mget("bench:c1", "bench:c2")
                await pipe.execute()

            row = []
            for step in (client.ping, claim):
                await _cpu_us(200, step)  # warm
                started = time.perf_counter()
                row.append(await _cpu_us(3000, step))
                row.append((time.perf_counter() - started) / 3000 * 1e6)
            await client.aclose()
            lines.append(f"| {SENDERS[direct]} | " + " | ".join(f"{x:.1f}" for x in row) + " |")
    lines.append("")
    return lines + await _drains(url, requests, batches, rounds, _sender, "write", SENDERS)


def main() -> None:
    """Measure what is asked and print Markdown tables."""
    parser = argparse.ArgumentParser(prog="python -m bench.costs", description=__doc__)
    parser.add_argument("--parts", default="pool,script,worker", help="comma-separated")
    parser.add_argument(
        "--rounds", type=int, default=2, help="pool, packing, sending: alternations"
    )
    parser.add_argument("--batch", type=int, default=16, help="script: requests a batch")
    parser.add_argument("--requests", type=int, default=4000, help="worker: requests")
    parser.add_argument("--batches", default="1,16,32", help="worker: batch sizes")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with tempfile.TemporaryDirectory() as data:
        server = start_redis(port, Path(data))
        try:
            if "pool" in parts:
                print("\n".join(asyncio.run(pool_costs(url, args.rounds))), end="\n\n")
            if "script" in parts:
                print("\n".join(script_costs(port, args.batch, 2000)), end="\n\n")
            batches = [int(b) for b in args.batches.split(",")]
            if "worker" in parts:
                print(WORKER_HEADER)
                print("|---:|---:|---:|---:|---:|---:|---:|")
                for batch in batches:
                    print(asyncio.run(worker_costs(url, args.requests, batch)))
            if "sending" in parts:
                run = _uvloop_run()
                lines = run(sending_costs(url, args.requests, batches, args.rounds))
                print("\n".join(lines), end="\n\n")
            if "packing" in parts:
                lines = asyncio.run(packing_costs(url, args.requests, batches, args.rounds))
                print("\n".join(lines), end="\n\n")
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
