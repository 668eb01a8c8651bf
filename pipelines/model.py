"""The model interface every stage's runner implements.

A model is constructed once per worker process (that is where weights load) and then
called with whole batches. The batch contract: ``predict`` takes a list of n items and
returns a list of n results, in the same order. The worker enforces it. A model whose
call can run long checks [`check_deadline`][] between its steps. A model for an
accelerator may split its call into three phases ([`StagedModel`][]), which the worker
overlaps across batches, and says when a call met a shape the device had not run before
([`cold_shape`][]). A model whose items are independent calls ([`ItemwiseModel`][])
runs each apart, beside the others.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
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

    The worker builds it once, from the stage's runner (a class, or a function returning
    a model), giving it only the options its signature takes
    (`workers.build.accepted`), so a plain ``class WordCounter`` with no
    ``__init__`` is built as ``WordCounter()``. The options offered: ``model`` (an HF id,
    a local path, or a runner-specific spec: the stage's ``model=``, or
    ``CONVEYOR_MODELS``), ``device`` (``cpu``, ``cuda``, ``cuda:N`` or ``auto``),
    ``dtype`` (``auto``, ``float32``, ``float16`` or ``bfloat16``) and ``cache_dir``
    (where generated assets may live); a constructor taking ``**kwargs`` gets them all.
    The stage's own ``options=`` are always given. A constructor that raises ends the
    worker with one line naming the stage and the runner.
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
        """[`Model.predict`][], also calling ``emit(index, text_so_far)`` from the model
        thread whenever item ``index``'s output text grows.

        Args:
            items: the batch.
            emit: progress callback; the worker forwards the new part to the client.
        """
        ...


@runtime_checkable
class StagedModel(Model, Protocol):
    """A model whose batch runs in three phases, so the worker overlaps them across
    batches: while the device runs batch n, batch n+1 is prepared on the host and batch
    n-1's output turned into results (`workers.runner.Runner`).

    A model whose device is the host (a runner on the CPU) says ``overlapped = False``:
    its phases then run as one call, since its host work would only contend with its
    compute for the same cores. ``predict(items)`` must equal
    ``finish(launch(prepare(items)))``; the worker falls back
    to ``predict`` (split in halves, `workers.contract.run_isolating`) when a phase
    raises, so a failing item still fails alone.
    """

    def prepare(self, items: list[Item]) -> Any:
        """Host work that needs no device: validate, tokenize, pad. Runs in a host thread,
        beside another batch's device work."""
        ...

    def launch(self, prepared: Any) -> Any:
        """Start the device's work on a prepared batch and return without waiting for it
        (on a GPU: copy the inputs and queue the kernels, then record an event). Runs in
        the model thread, one batch at a time, in the batch's turn."""
        ...

    def finish(self, launched: Any) -> Sequence[Result | BaseException]:
        """Wait for the device (a wait that releases the GIL: an event, not a spin) and
        turn its output into one result per item. Runs in a host thread, after the batch's
        turn, so the next batch launches meanwhile."""
        ...


@runtime_checkable
class ItemwiseModel(Model, Protocol):
    """A model whose items run apart, each a call of its own (a function step): the
    worker runs its batches beside each other, never one at a time on the model thread,
    so one slow item holds only itself (`workers.runner.Runner.run`).

    Attributes:
        concurrency: calls in flight at once, at most, in one worker.
    """

    concurrency: int

    def submit(self, item: Item, deadline: float) -> Future[Result | BaseException]:
        """Start the call on ``item`` and return at once. Its future holds its result, or
        what it raised, as a value ([`DeadlineExceeded`][pipelines.errors.DeadlineExceeded] when it
        was stopped at ``deadline``), and is done when the call has ended, never before:
        the worker reads from it whether an abandoned call still holds a thread.

        Args:
            item: one request's input.
            deadline: ``time.monotonic()`` past which nobody waits for it.
        """
        ...

    def cancel(self, call: Future[Result | BaseException]) -> None:
        """Ask ``call`` (what [`submit`][] returned) to stop where it can: an async
        call is cancelled; a sync one not yet started never starts, one running runs
        on (a thread cannot be stopped)."""
        ...

    def close(self) -> None:
        """Stop the calls still running where they can, and let their threads go."""
        ...


_running = threading.local()


def cold_shape() -> None:
    """Say, from a model call, that it ran a shape its device had not run before: the
    call's time is not the model's cost (a first call pays kernel selection, allocation),
    so the worker does not learn from it (`workers.policy`)."""
    _running.cold = True


@contextmanager
def watching_cold() -> Iterator[Callable[[], bool]]:
    """While in this block, [`cold_shape`][] calls in this thread are noted; the value
    given says whether one came."""
    before = getattr(_running, "cold", False)
    _running.cold = False
    try:
        yield lambda: bool(_running.cold)
    finally:
        _running.cold = before


@contextmanager
def batch_deadline(at: float) -> Iterator[None]:
    """While in this block, the batch running in this thread is worth finishing until
    ``at`` (``time.monotonic()``): its latest request's deadline. Set by the worker around
    each model call; read by [`check_deadline`][]."""
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
    """Stop a long model call early: raises [`DeadlineExceeded`][pipelines.errors.DeadlineExceeded]
    once every request of the running batch is past its deadline, so a shared model
    thread is never held for answers nobody waits for.

    A model whose call can run long (many chunks, many decoding steps) calls this
    between steps; the worker answers the batch's requests 504 (``expired``) and the
    next batch gets the model. Cheap: one clock read.
    """
    if time_left() <= 0:
        raise DeadlineExceeded("every request of the batch is past its deadline; stopped")
