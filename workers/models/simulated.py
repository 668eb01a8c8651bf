"""A simulated accelerator: real runners whose device charges a first call per new shape.

On a GPU each new input shape costs a first call (issue 24: ~80 ms for MiniLM on an H100),
and a worker that has not met a shape yet makes a request wait for it. On the CPU that
cost is a few milliseconds, so tests and benchmarks without a GPU would not see the
problem, or its fix. :class:`SimulatedDevice` puts it back: the first call of each
``(rows, tokens)`` shape sleeps ``first_call_s`` (a sleep releases the GIL, as a device's
wait does), and it counts the cold shapes it met. :class:`SimulatedEmbedder` is the real
:class:`~workers.models.hf_encode.Embedder` (real tokenizer, real weights, the same
buckets and warm-up) on such a device, which it reports as an accelerator, so its
buckets are on by default as on a GPU.

A stage names it like any runner: ``"workers.models.simulated:SimulatedEmbedder"``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from workers.models.hf_encode import Embedder

Shape = tuple[int, ...]


class SimulatedDevice:
    """Charges ``first_call_s`` the first time it runs a shape, and counts.

    Args:
        first_call_s: the extra cost of a shape's first call (slept, releasing the GIL).

    Attributes:
        calls: how often each shape ran.
        cold: how many calls met a shape for the first time.
    """

    def __init__(self, first_call_s: float = 0.08) -> None:
        if first_call_s < 0:
            raise ValueError(f"first_call_s must be >= 0, got {first_call_s}")
        self.first_call_s = first_call_s
        self.calls: Counter[Shape] = Counter()
        self.cold = 0
        self._lock = threading.Lock()  # stages sharing the weights may call from two threads

    def run(self, shape: Shape) -> None:
        """Account one call of ``shape``; a new shape pays its first-call cost."""
        with self._lock:
            first = shape not in self.calls
            self.calls[shape] += 1
            if first:
                self.cold += 1
        if first:
            time.sleep(self.first_call_s)

    @property
    def shapes(self) -> set[Shape]:
        """Every shape run so far."""
        with self._lock:
            return set(self.calls)


class SimulatedEmbedder(Embedder):
    """:class:`~workers.models.hf_encode.Embedder` on a :class:`SimulatedDevice`.

    Args:
        first_call_s: the device's first-call cost per shape.
        options: the :class:`~workers.models.hf_encode.Embedder`'s (``device`` is where
            the real computation runs, the CPU in tests).

    Attributes:
        sim: the simulated device (its counters are what tests read).
    """

    def __init__(self, *, first_call_s: float = 0.08, **options: Any) -> None:
        self.sim = SimulatedDevice(first_call_s)
        super().__init__(**options)

    @property
    def accelerated(self) -> bool:
        """An accelerator, for the buckets' default."""
        return True

    def forward(self, encoding: Mapping[str, torch.Tensor]) -> Any:
        """Charge the device for the batch's shape, then run the real model."""
        self.sim.run(tuple(encoding["input_ids"].shape))
        return super().forward(encoding)
