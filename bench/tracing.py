"""What tracing costs a request: conveyor on ``echo`` with OpenTelemetry off and on.

``python -m bench.tracing`` starts conveyor (redis-server, the gateway, one ``echo``
worker) three times per round: as configured by default (tracing off); with
``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing at a receiver in this process that reads and
discards what it is sent (so the exporter's whole cost is paid: every span built,
batched, encoded and posted); and the same sampling a tenth of the requests
(``OTEL_TRACES_SAMPLER=parentbased_traceidratio``, ``OTEL_TRACES_SAMPLER_ARG=0.1``).
Each is loaded by the bench's closed loop; the rounds alternate, so drift hits all alike.
It prints a Markdown table: requests/s, p50 and p99, and CPU ms per request of conveyor's
own processes (the receiver and the load generator excluded), each against tracing off.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.hotpath_spans import receiver
from bench.loadgen import closed_loop
from bench.systems import HOST, Options, conveyor
from bench.workloads import bodies

WORKLOAD = "echo"


@contextmanager
def discard() -> Iterator[str]:
    """An OTLP/HTTP endpoint on loopback that accepts every export and keeps nothing."""
    with receiver(keep=False) as (url, _):
        yield url


def measure(env: dict[str, str], concurrency: int, seconds: float) -> dict[str, float]:
    """One conveyor, loaded: req/s, p50 and p99 ms, CPU ms per request."""
    with (
        tempfile.TemporaryDirectory() as workdir,
        conveyor([WORKLOAD], Options(env=env), Path(workdir)) as server,
    ):
        load = bodies(3000)
        warm = closed_loop(HOST, server.port, "/v1/echo", load, concurrency, duration=1.5)
        asyncio.run(warm)
        cpu = server.cpu_seconds()
        result = asyncio.run(
            closed_loop(HOST, server.port, "/v1/echo", load * 20, concurrency, duration=seconds)
        )
        used = server.cpu_seconds() - cpu
    ok = max(1, result.statuses.get(200, 0))
    ordered = sorted(result.latencies)
    return {
        "rps": result.steady_ok / result.steady_seconds,
        "p50": 1000 * statistics.median(ordered),
        "p99": 1000 * ordered[int(0.99 * (len(ordered) - 1))],
        "cpu": 1000 * used / ok,
    }


def main(argv: list[str] | None = None) -> None:
    """Run the rounds and print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.tracing", description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args(argv)
    rows = []
    with discard() as endpoint:
        on = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
        tenth = on | {
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.1",
        }
        configs = {"off": {}, "on": on, "on, 10% sampled": tenth}
        for round_no in range(1, args.rounds + 1):
            figs = {
                name: measure(env, args.concurrency, args.seconds) for name, env in configs.items()
            }
            rows.append((round_no, figs))
    print(f"echo, {args.concurrency} clients, {args.seconds:g} s per measurement\n")
    print("| round | tracing | req/s | p50 ms | p99 ms | CPU ms/req | vs off |")
    print("|---|---|---|---|---|---|---|")
    for round_no, figs in rows:
        off = figs["off"]
        for name, fig in figs.items():
            versus = f"{fig['rps'] / off['rps']:.2f}x, +{fig['cpu'] - off['cpu']:.3f} ms"
            print(
                f"| {round_no} | {name} | {fig['rps']:.0f} | {fig['p50']:.1f} | "
                f"{fig['p99']:.1f} | {fig['cpu']:.3f} | {versus if fig is not off else ''} |"
            )


if __name__ == "__main__":
    main()
