"""What requests nobody waits for cost the model: clients that give up, with cancellation.

``python -m bench.cancel`` starts conveyor (redis-server, the gateway, one ``synthetic``
worker: a batch of n costs ``a + b·n`` of sleep, like an accelerator) and sends ``--clients``
requests at once whose clients give up (close their connections) after ``--give-up-s``.
Once the stage has settled (nothing waiting, nothing in flight) it reads the stage's
counters from ``/metrics`` and prints, as a Markdown table, how many items the model ran and
its time on them, against what it would have cost to run them all. Without cancellation the
model runs every abandoned request; with it, at most the batch already started.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import httpx

from bench.systems import HOST, ConveyorServer, Options, conveyor

STAGE = "synthetic"


LABEL = f'{{stage="{STAGE}"}}'
STAGE_LABEL = f'stage="{STAGE}"'
QUEUE = ("conveyor_stage_backlog{", "conveyor_stage_pending{")
CANCELLED = f'conveyor_stage_items_total{{stage="{STAGE}",outcome="cancelled"}}'


def stage_counters(server: ConveyorServer) -> dict[str, float]:
    """Every ``conveyor_stage_*`` series of ``/metrics``, by its name and labels."""
    text = httpx.get(f"http://{HOST}:{server.port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("conveyor_stage_"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def give_up(base: str, clients: int, after_s: float) -> int:
    """``clients`` requests at once, each abandoned after ``after_s``; how many gave up."""
    gave_up = 0

    async def one(i: int) -> None:
        nonlocal gave_up
        async with httpx.AsyncClient(base_url=base) as http:
            try:
                await http.post(f"/v1/{STAGE}", json={"text": f"item {i}"}, timeout=after_s)
            except httpx.TimeoutException:
                gave_up += 1

    await asyncio.gather(*(one(i) for i in range(clients)))
    return gave_up


def settle(server: ConveyorServer, limit_s: float) -> dict[str, float]:
    """Wait until the stage holds nothing (lag and pending 0); its counters then."""
    give_up_at = time.monotonic() + limit_s
    while True:
        now = stage_counters(server)
        # One series per lane (``lane`` label): the stage holds nothing when all are 0.
        gauges = [v for k, v in now.items() if k.startswith(QUEUE) and STAGE_LABEL in k]
        if gauges and not any(gauges):
            return now
        if time.monotonic() > give_up_at:
            raise RuntimeError(f"stage not settled in {limit_s:g} s: {now}")
        time.sleep(0.1)  # polling a server that is draining: no event to await


def main(argv: list[str] | None = None) -> None:
    """Run one measurement and print its table."""
    parser = argparse.ArgumentParser(prog="python -m bench.cancel", description=__doc__)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--give-up-s", type=float, default=0.2)
    parser.add_argument("--batch", type=int, default=8, help="the stage's max batch (8)")
    parser.add_argument("--a-ms", type=float, default=250.0, help="ms per batch (250)")
    parser.add_argument("--b-ms", type=float, default=10.0, help="ms per item (10)")
    args = parser.parse_args(argv)
    env = {"BENCH_SYNTHETIC_A_MS": str(args.a_ms), "BENCH_SYNTHETIC_B_MS": str(args.b_ms)}
    options = Options(max_batch=args.batch, env=env)
    with tempfile.TemporaryDirectory() as tmp, conveyor([STAGE], options, Path(tmp)) as server:
        before = settle(server, 60)
        started = time.monotonic()
        gave_up = asyncio.run(give_up(f"http://{HOST}:{server.port}", args.clients, args.give_up_s))
        after = settle(server, 600)
        drained_s = time.monotonic() - started

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    items = grew(f"conveyor_stage_model_items_total{LABEL}")
    model_s = grew(f"conveyor_stage_run_seconds_sum{LABEL}")
    batches = -(-args.clients // args.batch)
    all_s = (batches * args.a_ms + args.clients * args.b_ms) / 1000
    cancelled = grew(CANCELLED)
    print(
        f"`python -m bench.cancel --clients {args.clients} --give-up-s {args.give_up_s:g} "
        f"--batch {args.batch} --a-ms {args.a_ms:g} --b-ms {args.b_ms:g}`\n"
    )
    print(
        "| clients gave up | items the model ran | model s | model s to run all | "
        "counted cancelled | drained in s |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| {gave_up}/{args.clients} | {items:g} | {model_s:.2f} | {all_s:.2f} | "
        f"{cancelled:g} | {drained_s:.1f} |"
    )


if __name__ == "__main__":
    main()
