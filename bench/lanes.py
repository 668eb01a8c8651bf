"""Priority lanes: interactive latency with a bulk backlog waiting, and bulk's progress.

``python -m bench.lanes`` starts conveyor (redis-server, the gateway, one ``synthetic``
worker: a batch of n costs ``a + b·n`` of sleep, like an accelerator) and measures, in one
run:

1. interactive calls at ``--concurrency`` on the idle stage: their p50;
2. ``--bulk`` jobs submitted at once (jobs take the bulk lane), then the same interactive
   load while they wait: its p50, and the bulk items finished meanwhile (bulk req/s);
3. how long the bulk backlog takes to finish.

The issue's target: the loaded p50 is at most 1.5 times the idle p50 plus one batch time
(``a + b·max_batch``), while bulk still completes.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import httpx

from bench.loadgen import LoadResult, closed_loop
from bench.systems import HOST, ConveyorServer, Options, conveyor
from bench.workloads import bodies

STAGE = "synthetic"
LABEL = f'{{stage="{STAGE}",outcome="ok"}}'


def finished_ok(server: ConveyorServer) -> float:
    """Items the stage has answered ``ok`` so far (``/metrics``)."""
    text = httpx.get(f"http://{HOST}:{server.port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"conveyor_stage_items_total{LABEL}"):
            return float(line.rpartition(" ")[2])
    return 0.0


async def submit_jobs(base: str, count: int) -> None:
    """``count`` jobs of the stage, 64 submissions in flight (each answers 202 at once)."""
    gate = asyncio.Semaphore(64)
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:

        async def one(i: int) -> None:
            async with gate:
                resp = await http.post(f"/v1/jobs/{STAGE}", json={"text": f"bulk {i}"})
                resp.raise_for_status()

        await asyncio.gather(*(one(i) for i in range(count)))


def interactive(server: ConveyorServer, concurrency: int, seconds: float) -> LoadResult:
    """Interactive calls (the default lane of a sync call) for ``seconds``."""
    load = closed_loop(
        HOST, server.port, f"/v1/{STAGE}", bodies(100_000), concurrency, duration=seconds
    )
    return asyncio.run(load)


def main(argv: list[str] | None = None) -> None:
    """Run the three measurements and print their table."""
    parser = argparse.ArgumentParser(prog="python -m bench.lanes", description=__doc__)
    parser.add_argument("--bulk", type=int, default=2000, help="bulk jobs waiting (2000)")
    parser.add_argument("--concurrency", type=int, default=4, help="interactive clients (4)")
    parser.add_argument("--seconds", type=float, default=10.0, help="each interactive run (10)")
    parser.add_argument("--batch", type=int, default=32, help="the stage's max batch (32)")
    parser.add_argument("--a-ms", type=float, default=100.0, help="ms per batch (100)")
    parser.add_argument("--b-ms", type=float, default=5.0, help="ms per item (5)")
    args = parser.parse_args(argv)
    env = {"BENCH_SYNTHETIC_A_MS": str(args.a_ms), "BENCH_SYNTHETIC_B_MS": str(args.b_ms)}
    env["CONVEYOR_MAX_BACKLOG"] = str(max(1024, 2 * args.bulk))  # the bulk jobs all wait
    options = Options(max_batch=args.batch, env=env)
    with tempfile.TemporaryDirectory() as tmp, conveyor([STAGE], options, Path(tmp)) as server:
        idle = interactive(server, args.concurrency, args.seconds)
        before = finished_ok(server)
        asyncio.run(submit_jobs(f"http://{HOST}:{server.port}", args.bulk))
        loaded = interactive(server, args.concurrency, args.seconds)
        bulk_during = finished_ok(server) - before - (loaded.requests - loaded.errors)
        started = time.monotonic()
        while finished_ok(server) - before < args.bulk + loaded.requests - loaded.errors:
            time.sleep(0.1)  # polling a draining server: no event to await
        drain_s = time.monotonic() - started
    batch_ms = args.a_ms + args.b_ms * args.batch
    target = 1.5 * idle.pct(0.5) + batch_ms
    print(
        f"`python -m bench.lanes --bulk {args.bulk} --concurrency {args.concurrency} "
        f"--seconds {args.seconds:g} --batch {args.batch} --a-ms {args.a_ms:g} "
        f"--b-ms {args.b_ms:g}`\n"
    )
    print(
        "| interactive p50 idle ms | p50 with bulk waiting ms | target ms | met | "
        "bulk req/s meanwhile | bulk left drained in s |"
    )
    print("|---|---|---|---|---|---|")
    met = "yes" if loaded.pct(0.5) <= target else "no"
    print(
        f"| {idle.pct(0.5):.1f} | {loaded.pct(0.5):.1f} | {target:.1f} | {met} | "
        f"{bulk_during / loaded.seconds:.0f} | {drain_s:.1f} |"
    )


if __name__ == "__main__":
    main()
