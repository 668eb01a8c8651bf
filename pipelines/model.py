"""The model interface every stage's runner implements.

A model is constructed once per worker process (that is where weights load) and then
called with whole batches. The batch contract: ``predict`` takes a list of n items and
returns a list of n results, in the same order. The worker enforces it. A model whose
call can run long checks :func:`check_deadline` between its steps.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

from pipelines.errors import DeadlineExceeded

Item = dict[str, Any]
"""One request's payload as the stage's input model validated it (JSON types only)."""

Result = dict[str, Any]
"""One item's output: JSON types only (no numpy or torch values)."""


@runtime_checkable
class Model(Protocol):
    """Anything with a batched ``predict`` can be served.

    The worker builds it as ``factory(**options)`` where ``options`` always contains
    ``model`` (an HF id, a local path, or a runner-specific spec), ``device``
    (``cpu``, ``cuda``, ``cuda:N`` or ``auto``), ``dtype`` (``auto``, ``float32``,
    ``float16`` or ``bfloat16``) and ``cache_dir`` (where generated assets may live).
    """

    def predict(self, items: list[Item]) -> Sequence[Result | BaseException]:
        """Run the model on a whole batch.

        Args:
            items: the batch, oldest request first.

        Returns:
            One JSON-safe result per item, in the same order. An exception instance in
            an item's place fails that item alone; raising fails the batch, which the
            worker then retries split in halves to find the failing items.
        """
        ...


@runtime_checkable
class StreamingModel(Model, Protocol):
    """A model that can report each item's output as it grows (text generation)."""

    def predict_stream(
        self, items: list[Item], emit: Callable[[int, str], None]
    ) -> Sequence[Result | BaseException]:
        """:meth:`Model.predict`, also calling ``emit(index, text_so_far)`` from the model
        thread whenever item ``index``'s output text grows.

        Args:
            items: the batch.
            emit: progress callback; the worker forwards the new part to the client.
        """
        ...


_running = threading.local()


@contextmanager
def batch_deadline(at: float) -> Iterator[None]:
    """While in this block, the batch running in this thread is worth finishing until
    ``at`` (``time.monotonic()``): its latest request's deadline. Set by the worker around
    each model call; read by :func:`check_deadline`."""
    before = getattr(_running, "deadline", math.inf)
    _running.deadline = at
    try:
        yield
    finally:
        _running.deadline = before


def time_left() -> float:
    """Seconds until every request of the batch running in this thread is past its
    deadline (``inf`` outside a batch)."""
    return float(getattr(_running, "deadline", math.inf)) - time.monotonic()


def check_deadline() -> None:
    """Stop a long model call early: raises :class:`~pipelines.errors.DeadlineExceeded`
    once every request of the running batch is past its deadline, so a shared model
    thread is never held for answers nobody waits for.

    A model whose call can run long (many chunks, many decoding steps) calls this
    between steps; the worker answers the batch's requests 504 (``expired``) and the
    next batch gets the model. Cheap: one clock read.
    """
    if time_left() <= 0:
        raise DeadlineExceeded("every request of the batch is past its deadline; stopped")
