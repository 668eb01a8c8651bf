"""Prometheus exposition: metric families, cumulative-bucket histograms, their bucket
bounds, label text.

Both the gateway's own request metrics and the per-stage stats kept in Redis
(:mod:`runtime.stats`) are rendered with these. Each metric is a declared
:class:`Family` (name, type, help); an :class:`Exposition` collects samples by family
and writes each family's ``# HELP`` and ``# TYPE`` lines once, with all its samples
right after them, as the text format requires (a family's samples split by another's
read as untyped, and ``promtool check metrics`` refuses a family without help).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

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


def number(value: float) -> str:
    """A sample's value, exactly: a whole number in digits (``%g`` would write 1234567 as
    ``1.23457e+06``), any other as Python's shortest round-trip repr."""
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


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
        lines.append(f"{metric}_bucket{labels(**lab, le=le_label(bound))} {number(running)}")
    lines.append(f"{metric}_sum{labels(**lab)} {number(total)}")
    lines.append(f"{metric}_count{labels(**lab)} {number(running)}")
    return lines


@dataclass(frozen=True)
class Family:
    """One metric family of the exposition.

    Attributes:
        name: the metric's name (a counter's ends ``_total``; a histogram's samples add
            ``_bucket``, ``_sum`` and ``_count``).
        type: its Prometheus type.
        help: what it counts or measures, one line.
    """

    name: str
    type: Literal["counter", "gauge", "histogram"]
    help: str

    def header(self) -> list[str]:
        """Its ``# HELP`` and ``# TYPE`` lines."""
        text = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        return [f"# HELP {self.name} {text}", f"# TYPE {self.name} {self.type}"]


class Exposition:
    """Samples collected by family, written family by family.

    Args:
        families: every family it may hold, in the order they are written (a family
            with no samples is written too: its help and type say it exists).
    """

    def __init__(self, families: Iterable[Family]) -> None:
        self.samples: dict[Family, list[str]] = {family: [] for family in families}

    def add(self, family: Family, lines: Iterable[str]) -> None:
        """Add sample lines (name, labels, value) of ``family``."""
        self.samples[family].extend(lines)

    def sample(self, family: Family, value: float, **lab: str) -> None:
        """Add one sample of a counter or gauge ``family``, labelled ``lab``."""
        self.samples[family].append(f"{family.name}{labels(**lab) if lab else ''} {number(value)}")

    def text(self) -> str:
        """The exposition text, each family's header then its samples."""
        out: list[str] = []
        for family, lines in self.samples.items():
            out += family.header()
            out += lines
        return "\n".join(out) + "\n"
