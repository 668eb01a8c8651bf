"""Prometheus exposition: cumulative-bucket histograms, their bucket bounds, label text.

Both the gateway's own request metrics and the per-stage stats kept in Redis
(:mod:`pipelines.stats`) are rendered with these.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

BUCKETS: dict[str, tuple[float, ...]] = {
    "batch_size": (1, 2, 4, 8, 16, 32, 64, 128, 256),
    "queue_wait_seconds": _SECONDS,
    "run_seconds": _SECONDS,
}


def le_label(value: float) -> str:
    """A bucket bound as the stats hash and the exposition name it: ``%g``, or ``+Inf``."""
    return "+Inf" if value == float("inf") else f"{value:g}"


class Histogram:
    """Cumulative-bucket histogram; ``observe`` is cheap and local.

    Args:
        bounds: upper bounds of the finite buckets, ascending.
    """

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Add one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def fields(self, name: str) -> dict[str, float]:
        """Non-zero per-bucket increments as stats-hash fields (``h:name:le``)."""
        out: dict[str, float] = {}
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            if count:
                out[f"h:{name}:{le_label(bound)}"] = count
        out[f"h:{name}:sum"] = self.sum
        out[f"h:{name}:count"] = sum(self.counts)
        return out


def labels(**values: str) -> str:
    """Prometheus label set text, values escaped."""
    inner = ",".join(
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in values.items()
    )
    return "{" + inner + "}"


def histogram_lines(
    metric: str, bounds: Sequence[float], per_bucket: Sequence[float], total: float, **lab: str
) -> list[str]:
    """Exposition lines of one histogram series from per-bucket (non-cumulative) counts."""
    lines = []
    running = 0.0
    for bound, count in zip((*bounds, float("inf")), per_bucket, strict=True):
        running += count
        lines.append(f"{metric}_bucket{labels(**lab, le=le_label(bound))} {running:g}")
    lines.append(f"{metric}_sum{labels(**lab)} {total:g}")
    lines.append(f"{metric}_count{labels(**lab)} {running:g}")
    return lines
