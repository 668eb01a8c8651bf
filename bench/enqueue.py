"""``python -m bench.enqueue``: what a gateway's burst of enqueues costs the gateway and Redis.

A gateway enqueues the requests of one loop iteration in one round trip, a MULTI/EXEC of
their XADDs (:class:`gateway.enqueue.Enqueuer`). This starts a redis-server of its own on
a free loopback port and sends bursts of echo requests as a gateway writes them, through
conveyor's client on uvloop (as the gateway runs), each way in turn for ``--rounds``:

- ``redis-py``: redis-py's transaction pipeline (``pipeline(transaction=True)``), each
  reply read through the connection's ``read_response``;
- ``conveyor``: :func:`runtime.redisio.enqueue_burst` (:func:`runtime.packing.transaction`),
  the same commands in one buffer, the replies read from the parser within one timeout;
- ``script``: the XADDs in one Lua script call (``EVALSHA``, each XADD by ``redis.pcall``),
  a way conveyor does not take: its reply is one, but Redis's CPU a request is more.

It prints per request the client's CPU (this process, ``time.process_time``: packing,
sending, reading, the envelope's encoding included, alike in every way) and Redis's
(``INFO cpu``, system and user, its network work included); medians of the rounds, the
ways' order turned each round.
With ``--round-trips`` it also prices a worker's two other round trips each way (client
CPU per call): its claim, an HSET of on-model marks and an MGET of cancellation markers
in one pipeline (:func:`runtime.packing.pipelined` against redis-py's), and a publish's
one ``EVALSHA`` (:func:`runtime.packing.command` against redis-py's ``evalsha``).

CPU, not wall time, so the machine's other work matters less; still compare within a run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from bench.capacity import redis_cpu
from bench.costs import _uvloop_run
from conveyor.embedded import free_port, start_redis
from pipelines.envelope import FIELD, Request, encode, new_request_id
from pipelines.keys import Keys
from pipelines.settings import CommonSettings
from pipelines.tokens import COST
from runtime.packing import command, pipelined
from runtime.redisio import connect, enqueue, enqueue_burst, request_stream

WAYS = ("redis-py", "conveyor", "script")

SCRIPT = """
local out = {}
for i = 1, #KEYS do
  out[i] = redis.pcall('XADD', KEYS[i], '*', ARGV[1], ARGV[2 * i + 1], ARGV[2], ARGV[2 * i + 2])
end
return out
"""
"""The XADDs of a burst in one script call (``ARGV[1]``, ``ARGV[2]``: the fields' names)."""


def _burst(size: int, keys: Keys) -> list[Request]:
    """``size`` echo requests as a gateway writes them (its reply stream, a deadline)."""
    reply_to = keys.reply_stream("bench")
    return [
        Request(
            id=new_request_id(),
            pipeline="echo",
            stage="echo",
            step="echo",
            payload={"text": f"request {i} of a burst"},
            state={"input": {"text": f"request {i} of a burst"}},
            deadline=time.time() + 60,
            reply_to=reply_to,
            trace_id=new_request_id(),
            enqueue_by=time.time() + 5,
            reply_batches=True,
        )
        for i in range(size)
    ]


async def _pipeline(client: aioredis.Redis, keys: Keys, requests: list[Request]) -> list[Any]:
    pipe = client.pipeline(transaction=True)
    for request in requests:
        enqueue(pipe, keys, request)
    return list(await pipe.execute(raise_on_error=False))


async def _script(client: aioredis.Redis, keys: Keys, requests: list[Request]) -> list[Any]:
    values: list[Any] = []
    for request in requests:
        fields = encode(request)
        values += (fields[FIELD], fields[COST])
    streams = [request_stream(keys, r) for r in requests]
    script = _SCRIPTS.get(id(client))
    if script is None:  # made once per client: EVALSHA (EVAL once, on NOSCRIPT)
        script = _SCRIPTS[id(client)] = client.register_script(SCRIPT)
    answer: list[Any] = await script(keys=streams, args=[FIELD, COST, *values])
    return answer


_SCRIPTS: dict[int, AsyncScript] = {}


Send = Callable[[aioredis.Redis, Keys, list[Request]], Awaitable[list[Any]]]
SENDS: dict[str, Send] = {"redis-py": _pipeline, "conveyor": enqueue_burst, "script": _script}


async def _per_request(
    client: aioredis.Redis, info: redis.Redis, keys: Keys, send: Send, size: int, bursts: int
) -> tuple[float, float]:
    """(client CPU µs, Redis CPU µs) per request over ``bursts`` bursts of ``size``."""
    requests = _burst(size, keys)
    await send(client, keys, requests)  # warm (and the script cached)
    await client.delete(keys.stage_stream("echo"))
    redis_before, started = redis_cpu(info), time.process_time()
    for _ in range(bursts):
        answers = await send(client, keys, requests)
        assert all(isinstance(a, bytes) for a in answers), answers[:3]
    cpu = time.process_time() - started
    redis_used = redis_cpu(info) - redis_before
    await client.delete(keys.stage_stream("echo"))
    n = size * bursts
    return cpu / n * 1e6, redis_used / n * 1e6


async def measure(url: str, sizes: list[int], rounds: int, requests: int) -> list[str]:
    """The table: per burst size and way, medians over ``rounds`` alternations."""
    client = connect(CommonSettings(redis_url=url))
    info = redis.Redis.from_url(url)  # Redis's CPU, read outside the CPU measured
    keys = Keys("bench")
    found: dict[tuple[int, str], list[tuple[float, float]]] = {}
    try:
        for turn in range(rounds):
            ways = WAYS[turn % len(WAYS) :] + WAYS[: turn % len(WAYS)]  # turned each round
            for size in sizes:
                for way in ways:
                    bursts = max(1, requests // size)
                    got = await _per_request(client, info, keys, SENDS[way], size, bursts)
                    found.setdefault((size, way), []).append(got)
    finally:
        await client.aclose()
        info.close()
    lines = [
        "| burst | way | client CPU µs / request | Redis CPU µs / request |",
        "|---:|---|---:|---:|",
    ]
    for size in sizes:
        for way in WAYS:
            rows = found[size, way]
            client_us = statistics.median(r[0] for r in rows)
            redis_us = statistics.median(r[1] for r in rows)
            lines.append(f"| {size} | {way} | {client_us:.1f} | {redis_us:.1f} |")
    return lines


CLAIM = [("HSET", "bench:marks", b"1-1", b"m", b"1-2", b"m"), ("MGET", "bench:c1", "bench:c2")]
"""A worker's claim of a batch of two: its on-model marks and its cancellation check."""


async def round_trips(url: str, rounds: int, calls: int) -> list[str]:
    """Client CPU per round trip, redis-py's way and conveyor's
    (:func:`runtime.packing.pipelined`, :func:`runtime.packing.command`), alternating:
    a worker's claim (:data:`CLAIM`) and a publish's one ``EVALSHA``."""
    client = connect(CommonSettings(redis_url=url))
    sha = await client.script_load("return {0, {}, {}, {}}")
    evalsha = ("EVALSHA", sha, 2, "bench:a", "bench:b", "x", "y")

    async def claim_redis_py() -> None:
        pipe = client.pipeline(transaction=False)
        for args in CLAIM:
            pipe.execute_command(*args)
        await pipe.execute()

    async def claim_conveyor() -> None:
        await pipelined(client, CLAIM, raise_on_error=True)

    async def eval_redis_py() -> None:
        await client.evalsha(*evalsha[1:])

    async def eval_conveyor() -> None:
        await command(client, *evalsha)

    ways: dict[str, Callable[[], Awaitable[None]]] = {
        "claim (HSET + MGET), redis-py": claim_redis_py,
        "claim (HSET + MGET), conveyor": claim_conveyor,
        "EVALSHA, redis-py": eval_redis_py,
        "EVALSHA, conveyor": eval_conveyor,
    }
    found: dict[str, list[float]] = {}
    try:
        for _ in range(rounds):
            for name, call in ways.items():
                for _ in range(200):  # warm
                    await call()
                started = time.process_time()
                for _ in range(calls):
                    await call()
                found.setdefault(name, []).append((time.process_time() - started) / calls)
    finally:
        await client.aclose()
    lines = ["| round trip | client CPU µs |", "|---|---:|"]
    lines += [f"| {name} | {statistics.median(v) * 1e6:.1f} |" for name, v in found.items()]
    return lines


def main() -> None:
    """Measure and print Markdown tables."""
    parser = argparse.ArgumentParser(prog="python -m bench.enqueue", description=__doc__)
    parser.add_argument("--sizes", default="2,4,16", help="requests a burst, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the ways")
    parser.add_argument("--requests", type=int, default=6000, help="requests per measurement")
    parser.add_argument(
        "--round-trips", action="store_true", help="also a worker's claim and EVALSHA, each way"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    port = free_port()
    with tempfile.TemporaryDirectory() as data:
        server = start_redis(port, Path(data))
        try:
            run = _uvloop_run()
            url = f"redis://127.0.0.1:{port}/0"
            print("\n".join(run(measure(url, sizes, args.rounds, args.requests))), end="\n\n")
            if args.round_trips:
                print("\n".join(run(round_trips(url, args.rounds, 3000))))
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
