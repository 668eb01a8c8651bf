"""What joining a running generation costs: one long request, then several short ones
together, against each alone.

``python -m bench.joiners`` starts a conveyor serving the built-in ``generate`` stage
(redis-server, the gateway, one worker: the tiny GPT-2, offline, continuous decoding) and,
over real HTTP (non-streamed ``POST /v1/generate``), measures for ``--rounds`` rounds:

- a short request alone (``--short`` new tokens) and the long one alone (``--long``);
- the long one, then ``--joiners`` short ones sent together ``--after`` seconds later.

It prints the medians and the two ratios the continuous-decoding issue sets targets for:
the joiners' median over a short alone (target <= 3x) and the long one's latency with
joiners over alone (target <= 1.3x).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.systems import HOST, Options, conveyor

APP = "pipelines.builtin:builtin_pipelines"


async def _post(http: httpx.AsyncClient, tokens: int, text: str) -> float:
    started = time.perf_counter()
    resp = await http.post("/v1/generate", json={"text": text, "max_new_tokens": tokens})
    resp.raise_for_status()
    return time.perf_counter() - started


async def _round(
    http: httpx.AsyncClient, args: argparse.Namespace, index: int
) -> tuple[float, float, list[float], float]:
    """One round: a short alone, the long alone, the long with joiners."""
    short_alone = await _post(http, args.short, f"a short one {index}")
    long_alone = await _post(http, args.long, "once upon a time")

    async def joiner(i: int) -> float:
        await asyncio.sleep(args.after)
        return await _post(http, args.short, f"short number {i} of round {index}")

    long_task = asyncio.ensure_future(_post(http, args.long, "once upon a time"))
    shorts = await asyncio.gather(*(joiner(i) for i in range(args.joiners)))
    return short_alone, long_alone, list(shorts), await long_task


async def _drive(base: str, args: argparse.Namespace) -> list[str]:
    alone, longs, joined, slowed = [], [], [], []
    async with httpx.AsyncClient(base_url=base, timeout=300) as http:
        await _post(http, args.short, "warm")  # the first request is not the measure
        for index in range(args.rounds):
            short_alone, long_alone, shorts, long_joined = await _round(http, args, index)
            alone.append(short_alone)
            longs.append(long_alone)
            joined.extend(shorts)
            slowed.append(long_joined)
            print(
                f"round {index + 1}: short alone {short_alone:.3f}s, long alone "
                f"{long_alone:.3f}s, joiners {min(shorts):.3f}-{max(shorts):.3f}s, "
                f"long with them {long_joined:.3f}s",
                file=sys.stderr,
            )
    short_p50, long_p50 = statistics.median(alone), statistics.median(longs)
    joined_p50, slowed_p50 = statistics.median(joined), statistics.median(slowed)
    return [
        f"short alone p50 {short_p50:.3f}s; {args.joiners} joiners p50 {joined_p50:.3f}s "
        f"(range {min(joined):.3f}-{max(joined):.3f}s): {joined_p50 / short_p50:.2f}x "
        "(target <= 3x)",
        f"long alone p50 {long_p50:.3f}s; with joiners p50 {slowed_p50:.3f}s: "
        f"{slowed_p50 / long_p50:.2f}x (target <= 1.3x)",
    ]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.joiners", description=__doc__)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--joiners", type=int, default=8)
    p.add_argument("--short", type=int, default=8, help="new tokens of a short request")
    p.add_argument("--long", type=int, default=400, help="new tokens of the long request")
    p.add_argument("--after", type=float, default=0.3, help="seconds after the long one")
    p.add_argument("--max-batch", type=int, default=8, help="the stage's most sequences")
    p.add_argument("--workdir", type=Path, help="keep Redis and the log here (else a temp dir)")
    p.add_argument("--decoding", default="continuous", choices=["continuous", "static"])
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    options = Options(
        device="cpu", max_batch=args.max_batch, env={"CONVEYOR_DECODING": args.decoding}
    )
    with tempfile.TemporaryDirectory(prefix="bench-joiners-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        with conveyor(["generate"], options, workdir, name="joiners", app=APP) as server:
            lines = asyncio.run(_drive(f"http://{HOST}:{server.port}", args))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
