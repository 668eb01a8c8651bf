"""A GPU-like cost model: a batch of n items takes ``a + b·n`` seconds of sleep.

On an accelerator a batch costs a fixed launch-and-weights-read time plus a small
per-item time, and the host CPU is mostly idle meanwhile. ``time.sleep`` reproduces that
shape without burning the CPU, so what a benchmark of it measures is the serving path:
how well batches fill, and how the work spreads over worker processes.

Serve it with ``CONVEYOR_APP=bench.synthetic:pipelines``. The cost is read from
``BENCH_SYNTHETIC_A_MS`` and ``BENCH_SYNTHETIC_B_MS`` (defaults 20 and 1) when the
module is imported, so the gateway and every worker agree on the stage.
"""

from __future__ import annotations

import os
import time
from typing import Any

from pipelines.graph import single
from pipelines.model import Item, Result
from pipelines.stages import Stage, TextIn

A_MS = float(os.environ.get("BENCH_SYNTHETIC_A_MS", "20"))
B_MS = float(os.environ.get("BENCH_SYNTHETIC_B_MS", "1"))


class Synthetic:
    """Sleeps ``a_ms + b_ms·n`` milliseconds per batch of ``n`` and returns text lengths.

    Args:
        a_ms: fixed cost of a batch, milliseconds.
        b_ms: cost of each item, milliseconds.
        options: the common runner arguments (model, device, ...), ignored.
    """

    def __init__(self, *, a_ms: float = A_MS, b_ms: float = B_MS, **options: Any) -> None:
        del options
        if a_ms < 0 or b_ms < 0:
            raise ValueError(f"costs must be >= 0, got a_ms={a_ms}, b_ms={b_ms}")
        self.a_ms = a_ms
        self.b_ms = b_ms

    def cost_s(self, n: int) -> float:
        """Seconds a batch of ``n`` takes."""
        return (self.a_ms + self.b_ms * n) / 1000

    def predict(self, items: list[Item]) -> list[Result]:
        """Sleep for the batch's cost, then answer ``{"length": len(text)}`` per item."""
        time.sleep(self.cost_s(len(items)))
        return [{"length": len(str(item.get("text", "")))} for item in items]


SYNTHETIC = Stage(
    "synthetic",
    TextIn,
    runner="bench.synthetic:Synthetic",
    options={"a_ms": A_MS, "b_ms": B_MS},
    max_batch_size=32,
    batch_wait_ms=5.0,
    max_backlog=4096,
    summary=f"Sleeps {A_MS:g} ms + {B_MS:g} ms per item for each batch (GPU-like cost).",
)

pipelines = [single(SYNTHETIC)]
"""What ``CONVEYOR_APP=bench.synthetic:pipelines`` serves: ``POST /v1/synthetic``."""
