"""What one access line costs the gateway's event loop, per format and per way of making it.

``python -m bench.access`` sets logging up as the gateway does (``configure_logging``,
its stream ``/dev/null``) and writes ``--lines`` access lines through
:func:`gateway.edge.log_access` on a running event loop (yielding every 16 lines, as a
loaded gateway's turns hold several), for each format (``text``, ``json``) and each way:
``direct`` (the line made without a record: :func:`runtime.logs.direct_line`) and
``record`` (a filter that passes everything on the access logger sends it through a
``LogRecord`` and ``Logger.handle``, as before 2026-11-29). CPU µs per line, the median
of ``--rounds`` alternating rounds; compare rows of one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import time

from gateway.edge import access, log_access
from runtime.logs import configure_logging

SCOPE = {"type": "http", "method": "POST", "path": "/v1/echo"}
HEADERS = [(b"content-type", b"application/json"), (b"x-request-id", b"0" * 32)]


async def _lines(n: int) -> float:
    """CPU seconds per line of ``n`` access lines."""
    started = time.process_time()
    for i in range(n):
        log_access(SCOPE, "/v1/echo", 200, 0.0123, HEADERS)
        if i % 16 == 15:
            await asyncio.sleep(0)
    await asyncio.sleep(0)
    return (time.process_time() - started) / n


def _pass(record: logging.LogRecord) -> bool:
    return True


def measure(fmt: str, way: str, lines: int) -> float:
    """CPU µs per access line in format ``fmt``, made the ``way`` way."""
    configure_logging(level="INFO", format=fmt)
    if way == "record":
        access.addFilter(_pass)
    try:
        return 1e6 * asyncio.run(_lines(lines))
    finally:
        access.removeFilter(_pass)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.access", description=__doc__)
    parser.add_argument("--lines", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    stderr = sys.stderr
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115  (where configure_logging writes)
    try:
        got: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for fmt in ("text", "json"):
                for way in ("direct", "record"):
                    got.setdefault((fmt, way), []).append(measure(fmt, way, args.lines))
    finally:
        sys.stderr.close()
        sys.stderr = stderr
    print("| format | way | CPU µs per line (median; rounds) |")
    print("|---|---|---|")
    for (fmt, way), values in got.items():
        rounds = ", ".join(f"{v:.1f}" for v in values)
        print(f"| {fmt} | {way} | **{statistics.median(values):.1f}** ({rounds}) |")


if __name__ == "__main__":
    main()
