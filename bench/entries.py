"""``python -m bench.entries``: what one stream entry per request costs Redis, against one
entry per burst of requests (a design conveyor does not take).

Every request conveyor enqueues is its own entry of its stage's stream, so the stream's
own work is paid per request: the entry's ``XADD`` (a burst of them in one MULTI/EXEC, as
:func:`runtime.redisio.enqueue_burst` sends them), its place in the group's pending list
(``XREADGROUP``, then ``XACK``) and its on-model mark (``HSET``, then ``HDEL``:
:mod:`workers.claims`). This starts a redis-server of its own on a free loopback port and
runs those commands for bursts of echo requests as a gateway writes them
(:func:`bench.enqueue._burst`), each way in turn for ``--rounds``:

- ``entry per request``: conveyor's way, one entry per request;
- ``entry per burst``: the burst's requests as the fields of one entry (``e``, ``c``, then
  ``e1``, ``c1``, ...), so the stream's work is paid once a burst.

It prints Redis's work per request, medians of the rounds, the ways' order turned each
round: its command time (``INFO commandstats``, reset before each measurement) and its
CPU (``INFO cpu``, system and user, its network work included). What the second way would
cost elsewhere (a crash, a cancellation, a dead letter or a lease splitting an entry
again, batches that do not end where bursts do) is not measured: this prices only the
stream's part.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from bench.capacity import redis_cpu
from bench.enqueue import _burst
from conveyor.embedded import free_port, start_redis
from pipelines.envelope import encode
from pipelines.keys import GROUP, Keys

Way = Callable[[redis.Redis, str, list[dict[bytes, bytes]]], None]


def per_request(client: redis.Redis, stream: str, burst: list[dict[bytes, bytes]]) -> None:
    """One burst the way conveyor sends it: an entry per request."""
    pipe = client.pipeline(transaction=True)
    for fields in burst:
        pipe.xadd(stream, fields)  # type: ignore[arg-type]
    pipe.execute()
    _read_and_ack(client, stream, len(burst))


def per_burst(client: redis.Redis, stream: str, burst: list[dict[bytes, bytes]]) -> None:
    """One burst as one entry, each request's fields numbered after the first's."""
    joined: dict[bytes, bytes] = {}
    for i, fields in enumerate(burst):
        suffix = b"%d" % i if i else b""
        joined.update({name + suffix: value for name, value in fields.items()})
    client.xadd(stream, joined)  # type: ignore[arg-type]
    _read_and_ack(client, stream, len(burst))


def _read_and_ack(client: redis.Redis, stream: str, count: int) -> None:
    """What a worker does with the burst's entries: read, mark, then ack and unmark."""
    got: Any = client.xreadgroup(GROUP, "bench", {stream: ">"}, count=count)
    ids: list[bytes] = [eid for eid, _ in got[0][1]]
    marks = f"{stream}:marks"
    client.hset(marks, mapping={eid: b"%d:x" % len(ids) for eid in ids})
    pipe = client.pipeline(transaction=False)
    pipe.xack(stream, GROUP, *ids)
    pipe.hdel(marks, *ids)
    pipe.execute()


def _raw(value: object) -> bytes:
    """A field's name or value as Redis stores it."""
    if isinstance(value, bytes):
        return value
    return str(value).encode()


WAYS: dict[str, Way] = {"entry per request": per_request, "entry per burst": per_burst}


def measure(client: redis.Redis, size: int, rounds: int, bursts: int) -> list[str]:
    """The table for bursts of ``size``."""
    fields = [{_raw(k): _raw(v) for k, v in encode(r).items()} for r in _burst(size, Keys("bench"))]
    found: dict[str, tuple[list[float], list[float]]] = {w: ([], []) for w in WAYS}
    for turn in range(rounds):
        order = list(WAYS) if turn % 2 == 0 else list(reversed(WAYS))
        for name in order:
            stream = f"bench:entries:{size}:{turn}:{order.index(name)}"
            client.xgroup_create(stream, GROUP, id="0", mkstream=True)
            for _ in range(20):  # warm: the stream's first nodes
                WAYS[name](client, stream, fields)
            client.config_resetstat()
            before = redis_cpu(client)
            for _ in range(bursts):
                WAYS[name](client, stream, fields)
            cpu_s = redis_cpu(client) - before
            stats = client.info("commandstats")
            usec = sum(v["usec"] for k, v in stats.items() if k != "cmdstat_info")
            n = bursts * size
            found[name][0].append(usec / n)
            found[name][1].append(cpu_s * 1e6 / n)
            client.delete(stream, f"{stream}:marks")
    lines = [
        f"bursts of {size}, {bursts} a measurement, {rounds} rounds (medians; every round)",
        "",
        "| way | command µs per request | Redis CPU µs per request (`INFO cpu`) |",
        "|---|---:|---:|",
    ]
    for name, (commands, cpu) in found.items():
        each = ", ".join(f"{v:.1f}" for v in commands)
        each_cpu = ", ".join(f"{v:.1f}" for v in cpu)
        lines.append(
            f"| {name} | **{statistics.median(commands):.1f}** ({each}) | "
            f"**{statistics.median(cpu):.1f}** ({each_cpu}) |"
        )
    return lines


def main() -> None:
    """Measure and print Markdown tables."""
    parser = argparse.ArgumentParser(prog="python -m bench.entries", description=__doc__)
    parser.add_argument("--sizes", default="4,16", help="requests a burst, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the ways")
    parser.add_argument("--bursts", type=int, default=600, help="bursts per measurement")
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as data:
        server = start_redis(port, Path(data))
        try:
            client = redis.Redis(port=port)
            for size in (int(s) for s in args.sizes.split(",")):
                print("\n".join(measure(client, size, args.rounds, args.bursts)), end="\n\n")
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
