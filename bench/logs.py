"""How much a served stack logs under load, per log level.

``python -m bench.logs`` starts ``conveyor up --ephemeral --pipelines PIPELINE`` once per
level (``CONVEYOR_LOG_LEVEL``), drives it with ``--clients`` concurrent clients for
``--seconds``, stops it, and counts the lines and bytes ``up`` and its children wrote
between ``ready:`` and the stop. DEBUG is what every batch line costs (with its trace
ids, as INFO did before issue 29); INFO is the per-stage summary alone. It prints a
Markdown table; compare the rows of one run only (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from conveyor.embedded import free_port

CONVEYOR = str(Path(sys.executable).parent / "conveyor")
"""The ``conveyor`` command of this environment."""
BODY = {"text": "a cat sat on the mat and looked at the dog"}


async def drive(base: str, pipeline: str, clients: int, seconds: float) -> int:
    """Requests answered 200 by ``clients`` looping clients within ``seconds``."""
    done = 0
    stop_at = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            if (await http.post(f"/v1/{pipeline}", json=BODY)).status_code == 200:
                done += 1

    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return done


def measure(level: str, pipeline: str, clients: int, seconds: float) -> dict[str, float]:
    """One stack at ``level``: requests answered, and what it logged meanwhile."""
    port = free_port()
    env = dict(os.environ, CONVEYOR_LOG_LEVEL=level, HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "up.log"
        with out.open("wb") as sink:
            up = subprocess.Popen(
                [CONVEYOR, "up", "--ephemeral", "--port", str(port), "--pipelines", pipeline],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=folder,
            )
        try:
            deadline = time.monotonic() + 300
            while b"conveyor: ready:" not in out.read_bytes():
                if up.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"up did not get ready:\n{out.read_text()[-2000:]}")
                time.sleep(0.2)  # polling a file another process writes
            start = len(out.read_bytes())
            answered = asyncio.run(drive(f"http://127.0.0.1:{port}", pipeline, clients, seconds))
            logged = out.read_bytes()[start:]
        finally:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=120)
    return {
        "requests": answered,
        "lines": logged.count(b"\n"),
        "kb": len(logged) / 1024,
    }


def main(argv: list[str] | None = None) -> None:
    """Measure each level and print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.logs", description=__doc__)
    parser.add_argument("--pipeline", default="embed")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--levels", default="DEBUG,INFO")
    args = parser.parse_args(argv)
    print(f"{args.pipeline}, {args.clients} clients, {args.seconds:g} s\n")
    print("| level | requests | req/s | lines | KB | lines per 1,000 requests |")
    print("|---|---:|---:|---:|---:|---:|")
    for level in args.levels.split(","):
        got = measure(level, args.pipeline, args.clients, args.seconds)
        per_k = 1000 * got["lines"] / max(1, got["requests"])
        print(
            f"| {level} | {got['requests']:,.0f} | {got['requests'] / args.seconds:,.0f} "
            f"| {got['lines']:,.0f} | {got['kb']:,.1f} | {per_k:,.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
