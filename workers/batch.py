"""The batch contract (n items in, n results out, a failing item fails alone) and the
thread the model runs it in."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from pipelines.envelope import wire_problem
from pipelines.errors import BatchContractError, DeadlineExceeded, InvalidInput
from pipelines.model import Item, Model, Result, StreamingModel, batch_deadline
from pipelines.stages import Stage
from workers.build import build_model, prepare_shapes
from workers.settings import WorkerSettings


class Entry(NamedTuple):
    """A stream entry as redis-py reads it (its id and its fields), and the stream (the
    stage's stream of one lane) it was read from: where it is acked, touched, counted."""

    id: bytes
    fields: dict[bytes, bytes]
    stream: str


def by_stream(entries: Iterable[Entry]) -> dict[str, list[bytes]]:
    """The ids of ``entries``, grouped by the stream each came from (in entry order)."""
    out: dict[str, list[bytes]] = {}
    for entry in entries:
        out.setdefault(entry.stream, []).append(entry.id)
    return out


Emit = Callable[[int, str], None]
"""Streamed output from the model thread: row ``index`` now reads ``text``."""


def contract(items: list[Item], results: object) -> list[Result | BaseException]:
    if not isinstance(results, (list, tuple)) or len(results) != len(items):
        got = len(results) if isinstance(results, (list, tuple)) else type(results).__name__
        raise BatchContractError(
            f"predict() got {len(items)} items and returned {got}; "
            "it must return one result per item, in order"
        )
    return list(results)


def run_isolating(model: Model, items: list[Item]) -> list[Result | BaseException]:
    """Run ``model`` on ``items``; if the batch fails, retry it split in halves.

    A failing item thus fails alone, at the cost of about log2(n) extra model calls
    for the batch it was in; the other items' results are the model's own.

    Raises nothing: an item's failure is returned in its place.
    """
    try:
        return contract(items, model.predict(items))
    except DeadlineExceeded as exc:
        return [exc] * len(items)  # the whole batch is out of time: no half would run
    except Exception as exc:
        if len(items) == 1:
            return [exc]
        mid = len(items) // 2
        return run_isolating(model, items[:mid]) + run_isolating(model, items[mid:])


def timed_run(
    model: Model, items: list[Item], emit: Emit | None, left_s: float = math.inf
) -> tuple[list[Result | BaseException], float]:
    """Run the batch (see :func:`run_isolating`); ``left_s``: until its latest request's
    deadline, counted from when it was handed to the model thread (what
    :func:`~pipelines.model.check_deadline` stops a long call at)."""
    # Timed in the model thread, so time spent queued behind another batch is excluded.
    started = time.perf_counter()
    results: list[Result | BaseException] | None = None
    with batch_deadline(time.monotonic() + left_s):
        if emit is not None and isinstance(model, StreamingModel):
            try:
                results = contract(items, model.predict_stream(items, emit))
            except DeadlineExceeded as exc:
                results = [exc] * len(items)
            except Exception:
                # Find the failing items without streaming; what was streamed is not resent.
                results = None
        if results is None:
            results = run_isolating(model, items)
    return results, time.perf_counter() - started


class ModelThread:
    """The one thread a loaded model runs in, and the turns batches take on it.

    Stages of one process whose models share weights (their models name the same
    ``weights_key``) share one :class:`ModelThread` (:func:`model_thread`), so their
    batches take turns on the weights and never run on them at once.

    Attributes:
        busy: batches waiting for their turn or in it, of every stage on it.
        users: the runners on it; the thread goes with the last.
    """

    def __init__(self, name: str) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"model-{name}")
        self.turns = asyncio.Lock()  # FIFO: batches run in the order they asked
        self.free = asyncio.Event()  # set while busy is 0
        self.free.set()
        self.busy = 0
        self.users = 1

    def release(self) -> None:
        """One runner less; the last lets the thread go (a batch in it finishes)."""
        self.users -= 1
        if not self.users:
            self.executor.shutdown(wait=False)


_SHARED: weakref.WeakValueDictionary[tuple[object, Hashable], ModelThread] = (
    weakref.WeakValueDictionary()
)


def model_thread(weights_key: Hashable, name: str) -> ModelThread:
    """The model thread of the weights ``weights_key`` names in this event loop: the one
    another stage already runs them in, else a new one.

    Args:
        weights_key: what the model says its weights are (hashable).
        name: names a new thread (``model-{name}``).
    """
    key = (asyncio.get_running_loop(), weights_key)  # asyncio's lock belongs to one loop
    found = _SHARED.get(key)
    if found is not None and found.users:  # one whose last user left has let its thread go
        found.users += 1
        return found
    _SHARED[key] = made = ModelThread(name)
    return made


class Runner:
    """The stage's model and the one thread it runs in, a batch at a time.

    A batch runs in its turn (:meth:`turn`), taken in the order asked for, so what it does
    just before the model starts (ask which of its requests were cancelled while it
    waited) is done when the model is free, not when the batch closed. A model that names
    its weights (a ``weights_key`` attribute, as the Hugging Face runners do) runs in the
    thread of the other stages of the process on the same weights (:func:`model_thread`):
    their batches take turns, and :attr:`busy` counts theirs too.

    Args:
        stage: the stage served.
        settings: the worker's settings (how its model is built).
        model: an already-built model (tests, embedding); built by :meth:`load` if None.

    Attributes:
        last_run_s: the model time of the last batch.
    """

    def __init__(self, stage: Stage, settings: WorkerSettings, model: Model | None) -> None:
        self.stage, self.settings, self.model = stage, settings, model
        self.last_run_s = 0.0
        self.thread = ModelThread(stage.name)
        self._shared = False
        self._shaped = False  # buckets set and warmed (prepare_shapes), once
        self._closed = False
        # The workers of a stage's partitions share a runner and start together: the
        # model is built once, by the first; the others wait for it.
        self._loading = asyncio.Lock()

    @property
    def busy(self) -> int:
        """Batches waiting for the model or in it (its sharers' included)."""
        return self.thread.busy

    async def load(self) -> None:
        """Build the stage's model (in the model thread) unless there is one; then move
        to the thread of its weights' other stages, if any, and there give it its shape
        buckets and warm them (:func:`~workers.build.prepare_shapes`: queued behind its
        sharers' batches, never beside them)."""
        async with self._loading:
            if self.model is None:
                loop = asyncio.get_running_loop()
                args = (self.stage, self.settings)
                self.model = await loop.run_in_executor(self.thread.executor, build_model, *args)
            key = getattr(self.model, "weights_key", None)
            if key is not None and not self._shared:
                self._shared = True
                self.thread.release()
                self.thread = model_thread(key, self.stage.name)
            if not self._shaped:
                loop = asyncio.get_running_loop()
                shaping = (self.model, self.stage, self.settings)
                await loop.run_in_executor(self.thread.executor, prepare_shapes, *shaping)
                self._shaped = True

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold the model for one batch (:meth:`run` it inside), after the batches that
        asked before; busy from the asking."""
        thread = self.thread
        thread.busy += 1
        thread.free.clear()
        try:
            async with thread.turns:
                yield
        finally:
            thread.busy -= 1
            if not thread.busy:
                thread.free.set()
        if thread.busy:
            # The next batch takes the model (sends its cancellation check) before this
            # one spends the event loop on its results and their publish, which would
            # keep the model idle meanwhile (~4 ms a batch of 32 embeddings).
            await asyncio.sleep(0)

    async def freed(self, timeout_s: float) -> None:
        """Return once no batch holds the model or waits for it, or ``timeout_s`` later."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.thread.free.wait()

    async def run(
        self, items: list[Item], emit: Emit | None, left_s: float = math.inf
    ) -> tuple[list[Result | BaseException], float]:
        """Each item's result or error, and the model time (see :func:`timed_run`); in
        the batch's :meth:`turn`. ``left_s``: until the latest deadline of the batch's
        requests."""
        assert self.model is not None
        loop = asyncio.get_running_loop()
        args = (self.model, items, emit, left_s)
        results, run_s = await loop.run_in_executor(self.thread.executor, timed_run, *args)
        self.last_run_s = run_s
        return results, run_s

    def close(self) -> None:
        """Let the model thread go, unless another stage still runs in it (a batch still
        in it finishes on its own). Once: a second close must not count this runner off
        again, or the shared thread's users drop below zero, which reads as in use and
        hands the next stage on the same weights a thread already shut down."""
        if not self._closed:
            self._closed = True
            self.thread.release()


@dataclass
class BatchRecord:
    """What one batch did (kept in memory for tests and introspection).

    Attributes:
        size: entries in the batch.
        oldest_ms: arrival time of its oldest entry (server ms).
        closed_at: when assembly ended (server clock, seconds).
        run_s: model time.
        outcomes: items per outcome.
        request_ids: ids of the requests, in batch order.
        trace_ids: their trace ids (logged with the batch).
        arrivals: when each request arrived (server clock, seconds), as ``request_ids``.
        ran_at: when the model finished the batch (server clock; 0: it did not run).
        tokens: the estimated tokens of the items the model ran (:mod:`workers.lengths`).
        padded_tokens: those items times the longest of them: what the model padded to.
    """

    size: int
    oldest_ms: int
    closed_at: float
    run_s: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    request_ids: list[str] = field(default_factory=list)
    trace_ids: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    ran_at: float = 0.0
    tokens: int = 0
    padded_tokens: int = 0


def plain(value: Any) -> Any:
    """``value`` with numpy's and torch's scalars and arrays (anything with ``tolist``)
    and subclasses of ``float`` and ``int`` turned into plain Python, as a model's
    results often hold them; anything else is left for :func:`wire_problem` to name."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, str | bytes | bool) or value is None:
        return value
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return plain(tolist())
    if isinstance(value, float):
        return float(value)
    if isinstance(value, int):
        return int(value)
    return value


def checked(res: Result | BaseException) -> Result | BaseException:
    """The result, or an error in its place when it is not a JSON object an envelope can
    carry (checked per item, so one bad value cannot fail the whole publish)."""
    if isinstance(res, BaseException):
        return res
    if not isinstance(res, dict):
        return TypeError(f"result is {type(res).__name__}, not an object")
    problem = wire_problem(res)
    if problem is None or problem.type == "json_type":
        try:
            orjson.dumps(res)  # a float subclass (numpy's) passes the check, not every encoder
            if problem is None:
                return res
        except TypeError:
            pass
        try:
            res = plain(res)
        except RecursionError:
            return TypeError("result is nested too deep")
        problem = wire_problem(res)
        if problem is None:
            return res
    where = ".".join(map(str, problem.loc)) or "the result"
    # Usually the input's doing (1e308 doubled is infinite), so the client hears 422.
    return InvalidInput(
        f"the result cannot be sent: {where}: {problem.msg}",
        [{"loc": ["result", *problem.loc], "msg": problem.msg, "type": problem.type}],
    )
