"""A stage with a synthetic cost model, served by real worker processes in the autoscaling
tests (``CONVEYOR_APP=tests.support.scaleapp:pipelines``).

Its model sleeps ``fixed_s + per_item_s * n`` per batch of n: sleeping releases the CPU, so
several workers scale past the machine's cores, as workers waiting on an accelerator would.
Kept free of test-only imports so a worker process starts fast.
"""

from __future__ import annotations

import os
import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipelines.graph import Pipeline, single
from pipelines.model import Item, Result
from pipelines.stages import Stage


class ValueIn(BaseModel):
    """Input of the synthetic stage."""

    model_config = ConfigDict(extra="forbid")
    value: int


class CostModel:
    """Doubles ``value`` after sleeping ``fixed_s + per_item_s * len(batch)``; each result
    names the process that ran it.

    Args:
        fixed_s: cost of a batch, whatever its size.
        per_item_s: cost of each item in it.
        options: the common runner arguments, unused.
    """

    def __init__(self, *, fixed_s: float = 0.1, per_item_s: float = 0.02, **options: Any) -> None:
        del options
        self.fixed_s = fixed_s
        self.per_item_s = per_item_s

    def predict(self, items: list[Item]) -> list[Result]:
        """Sleep the batch's cost, then double each value."""
        time.sleep(self.fixed_s + self.per_item_s * len(items))
        return [{"value": item["value"] * 2, "pid": os.getpid()} for item in items]


SYNTHETIC = Stage(
    "synthetic",
    ValueIn,
    "tests.support.scaleapp:CostModel",
    options={"fixed_s": 0.1, "per_item_s": 0.02},
    max_batch_size=8,
    batch_wait_ms=20,
)

pipelines: list[Pipeline] = [single(SYNTHETIC)]
