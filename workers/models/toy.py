"""Runners without an ML framework: measure serving overhead and drive the built-in pipelines."""

from __future__ import annotations

from typing import Any

from pipelines.model import Item, Result


class Echo:
    """Returns each item unchanged: measures serving overhead without a model.

    Args:
        options: accepted and ignored, so it takes the same arguments as every runner.
    """

    def __init__(self, **options: Any) -> None:
        del options

    def predict(self, items: list[Item]) -> list[Result]:
        """Return the batch as it came."""
        return list(items)


class Adder:
    """Adds one to ``value`` (a batched model without ML, for the built-in pipelines)."""

    def __init__(self, **options: Any) -> None:
        del options

    def predict(self, items: list[Item]) -> list[Result]:
        """``value + 1`` for each item."""
        return [{"value": item["value"] + 1} for item in items]


class Multiplier:
    """Doubles ``value`` (a batched model without ML, for the built-in pipelines)."""

    def __init__(self, **options: Any) -> None:
        del options

    def predict(self, items: list[Item]) -> list[Result]:
        """``value * 2`` for each item."""
        return [{"value": item["value"] * 2} for item in items]
