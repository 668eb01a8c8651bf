"""``python -m bench.wire``: what checking a request against the wire costs, per request.

The gateway parses each body with :func:`gateway.body.parse_body` (the standard library's
parser with hooks, then :func:`pipelines.envelope.wire_problem`) where FastAPI would call
``json.loads``, checks the validated payload once more before enqueueing, and a worker
checks each result before publishing. This times each step on the benchmark's own bodies
(``bench.workloads.bodies``) and on an embedding-sized result, in one process, one after
the other, best of several repeats, and prints microseconds per call and the ratios.
"""

from __future__ import annotations

import json
import timeit
from collections.abc import Callable

from bench.workloads import bodies
from gateway.body import parse_body
from pipelines.envelope import wire_problem


def best_us(call: Callable[[], object], number: int = 2000, repeat: int = 7) -> float:
    """The fastest of ``repeat`` runs of ``number`` calls, in microseconds per call."""
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    """Print the table."""
    body = bodies(1)[0]
    payload = json.loads(body)
    embedding = {"embedding": [0.01 * i for i in range(384)]}
    rows = {
        "json.loads (FastAPI's parse)": best_us(lambda: json.loads(body)),
        "parse_body (ours: parse + check)": best_us(lambda: parse_body(body)),
        "wire_problem(payload) at enqueue": best_us(lambda: wire_problem(payload)),
        "wire_problem(384-float result)": best_us(lambda: wire_problem(embedding)),
    }
    print(f"body: {len(body)} bytes")
    for name, us in rows.items():
        print(f"{name:36s} {us:8.2f} us")
    base = rows["json.loads (FastAPI's parse)"]
    added = (
        rows["parse_body (ours: parse + check)"] - base + rows["wire_problem(payload) at enqueue"]
    )
    print(f"added at the gateway per request: {added:.2f} us ({added / base:.1f}x json.loads)")


if __name__ == "__main__":
    main()
