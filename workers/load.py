"""What batching asks of the model's owner: how loaded the model is.

The window (:mod:`workers.window`) and the lanes (:mod:`workers.lanes`) decide when a
batch goes and what it takes by whether the model is busy; they ask this protocol, which
:class:`workers.runner.Runner` (the one owner of "is the model busy") satisfies, and never
import the runner itself.
"""

from __future__ import annotations

from typing import Protocol


class Load(Protocol):
    """The model's load, as batching sees it."""

    @property
    def busy(self) -> int:
        """Batches waiting for the model or in it (its sharers' included)."""
        ...

    @property
    def last_run_s(self) -> float:
        """The model time of the last batch."""
        ...

    @property
    def accelerated(self) -> bool:
        """Whether the model runs on an accelerator (a batch's cost is nearly flat in
        its tokens there, until saturation)."""
        ...

    @property
    def input_cap(self) -> int | None:
        """The model's input cap in tokens, where it has one (None: none, or not loaded)."""
        ...

    async def freed(self, timeout_s: float) -> None:
        """Return once no batch holds the model or waits for it, or ``timeout_s`` later."""
        ...
