"""The stage's model and the phases a batch goes through on it: prepared, its turn taken,
launched (partial output streamed as it comes), finished; :meth:`Runner.run` returns
what ran and learns nothing itself.

A batch runs on the model in its turn (:meth:`Runner.turn`), one batch at a time. A
:class:`~pipelines.model.StagedModel` (a model for an accelerator) splits its call so the
device never waits on the host: :meth:`Runner.prepare` tokenizes batch n+1 in a host
thread before its turn, while batch n is on the device; in the turn, :meth:`Runner.launch`
only queues the device's work; :meth:`Runner.finish` waits for it (a wait that releases
the GIL) and makes the results in a host thread after the turn, while the next batch
launches. Any other model runs whole in :meth:`Runner.launch`. An
:class:`~pipelines.model.ItemwiseModel` (a function step) takes no turn: each item is a
call of its own, beside every other batch's (:mod:`workers.apart`). Whatever user code
raises fails its items, never the worker (:mod:`workers.modelthread` watches for calls
that hang).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pipelines.errors import DeadlineExceeded
from pipelines.model import (
    Item,
    ItemwiseModel,
    Model,
    StagedModel,
    StreamingModel,
    batch_deadline,
    watching_cold,
)
from pipelines.stages import Stage
from workers.apart import Apart
from workers.build import build_model, prepare_shapes
from workers.contract import Breaches, contract, run_isolating
from workers.lengths import input_cap
from workers.modelthread import ModelThread, Raised, Watchdog, caught, model_thread
from workers.settings import WorkerSettings
from workers.values import Batch, Emitter, Ran, Results, Turn

if TYPE_CHECKING:  # torch is imported by the models that decode, not by every worker
    from workers.models.decoder import Decoder

logger = logging.getLogger(__name__)

T = TypeVar("T")

Emit = Callable[[int, str], None]
"""Streamed output from the model thread: row ``index`` now reads ``text``."""


def whole_run(model: Model, items: list[Item], emit: Emit | None) -> Results:
    """Run the batch in one call (see :func:`~workers.contract.run_isolating`), streaming
    through ``emit`` where the model can."""
    if emit is not None and isinstance(model, StreamingModel):
        try:
            return contract(items, model.predict_stream(items, emit))
        except DeadlineExceeded as exc:
            return [exc] * len(items)
        except BaseException:  # whatever user code raises (SystemExit too) is its failure
            pass  # find the failing items without streaming; what was streamed is not resent
    return run_isolating(model, items)


@dataclass
class Prepared:
    """A staged model's batch after its host phase (or the error that phase raised)."""

    items: list[Item]
    value: Any = None
    error: BaseException | None = None


@dataclass
class Launched:
    """A batch after its turn: on the device (``value``), or already done (``results``)."""

    items: list[Item]
    deadline: float
    started: float  # perf_counter when its turn's work began
    cold: bool
    value: Any = None
    results: Results | None = None
    took_s: float = 0.0  # a whole run's time


class Runner:
    """The stage's model, the one thread it runs in, a batch at a time, and the host
    threads a staged model's other phases run in.

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
        runner = stage.runner if isinstance(stage.runner, str) else repr(stage.runner)
        self.breaches = Breaches(stage.name, runner)  # noted in every model-thread call
        max_call_s = stage.max_call_s if settings.max_call_s is None else settings.max_call_s
        self.watchdog = Watchdog(stage.name, settings.hung_grace_s, self.breaches, max_call_s)
        self.thread = ModelThread(stage.name)
        self.apart = Apart(stage.name, settings.hung_grace_s)  # an itemwise model's batches
        # Two: one batch's preparation beside another's wait for the device.
        self.host = ThreadPoolExecutor(2, thread_name_prefix=f"host-{stage.name}")
        self._shared = False
        self._shaped = False  # buckets set and warmed (prepare_shapes), once
        self._warm: Decoder | None = None  # the decoder warmed at load, for the first loop
        self._closed = False
        self._kinds_of: object = None  # the model whose kinds _kinds holds (see is_a)
        self._kinds: dict[type, bool] = {}
        # The workers of a stage's partitions share a runner and start together: the
        # model is built once, by the first; the others wait for it.
        self._loading = asyncio.Lock()

    @property
    def busy(self) -> int:
        """Batches waiting for the model or in it (its sharers' included)."""
        return self.thread.busy

    @property
    def input_cap(self) -> int | None:
        """The model's input cap in tokens (:func:`workers.lengths.input_cap`)."""
        return input_cap(self.model)

    @property
    def concurrency(self) -> int | None:
        """The calls an :class:`~pipelines.model.ItemwiseModel` runs at once: its batches
        run apart, one item each (:meth:`run`); None for any other model."""
        return cast(ItemwiseModel, self.model).concurrency if self.is_a(ItemwiseModel) else None

    def is_a(self, kind: type) -> bool:
        """``isinstance(self.model, kind)``, remembered while the model is the same object:
        a runtime-checkable protocol's check walks its members each time (~30 µs here)."""
        model = self.model
        if model is not self._kinds_of:
            self._kinds_of, self._kinds = model, {}
        known = self._kinds.get(kind)
        if known is None:
            known = self._kinds[kind] = isinstance(model, kind)
        return known

    @property
    def overlapped(self) -> bool:
        """:func:`overlapped` of its model, whose kind :meth:`is_a` remembers."""
        return overlapped(self.model, self.is_a(StagedModel))

    @property
    def accelerated(self) -> bool:
        """Whether its model runs on an accelerator (it says ``accelerated``)."""
        return bool(getattr(self.model, "accelerated", False))

    async def load(self) -> None:
        """Build the stage's model (in the model thread) unless there is one; then move
        to the thread of its weights' other stages, if any, and there give it its shape
        buckets and warm them (:func:`~workers.build.prepare_shapes`: queued behind its
        sharers' batches, never beside them)."""
        async with self._loading:
            if self.model is None:
                args = (self.stage, self.settings)
                self.model = await self._in(self.thread.executor, build_model, *args)
            key = getattr(self.model, "weights_key", None)
            if key is not None and not self._shared:
                self._shared = True
                self.thread.release()
                self.thread = model_thread(key, self.stage.name)
            if not self._shaped:
                shaping = (self.model, self.stage, self.settings)
                await self._in(self.thread.executor, prepare_shapes, *shaping)
                self._shaped = True
                self._warm = await self._decoder(warm=self.settings.warmup)

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold the model for one batch (:meth:`launch` it inside), after the batches that
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

    async def run(self, batch: Batch, turn: Turn, deadline: float) -> Ran | None:
        """Run ``batch``'s live items on the model and return what ran (None: nothing
        did), streaming partial output as it comes.

        A staged model prepares the batch before its turn, beside the batch on the
        device (``turn.before_host`` first: user code runs there). Once the model is the
        batch's, ``turn.at_turn`` withdraws the requests cancelled while it waited; its
        results are made after the turn, while the next batch launches. An itemwise
        model's batch takes no turn (:class:`~workers.apart.Apart`).

        Args:
            batch: the batch opened by :meth:`workers.intake.Intake.open`.
            turn: what the worker does around the model (the step's hooks).
            deadline: ``time.monotonic()`` of the batch's latest deadline.
        """
        if not batch.live:
            return None
        if self.is_a(ItemwiseModel):
            itemwise = cast(ItemwiseModel, self.model)
            return await self.apart.run(itemwise, batch, turn, deadline)
        emitter: Emitter | None = None
        try:
            staged = self.overlapped
            if staged:  # its host phase runs user code before its turn
                await turn.before_host(batch)
            prepared = await self.prepare([item for _, item in batch.live], deadline)
            async with self.turn():
                emitter = await turn.at_turn(batch, mark=not staged)
                if not batch.live:
                    return None
                items = [item for _, item in batch.live]
                emit = emitter.emit if emitter is not None and emitter.wanted else None
                launched = await self.launch(items, emit, deadline, prepared)
            ran = await self.finish(launched)
        finally:
            if emitter is not None:
                await emitter.close()  # every partial is out before the final reply
        for result in ran.results:  # said and counted, then failed alone (route.py)
            if not isinstance(result, dict | BaseException):
                self.breaches.note(f"a result is {type(result).__name__}")
        return ran

    async def prepare(self, items: list[Item], deadline: float) -> Prepared | None:
        """A staged model's host phase for ``items``, in a host thread (before the
        batch's turn, beside the device's work on another); None for any other model.

        Args:
            items: the batch's items.
            deadline: ``time.monotonic()`` past which nobody waits for any of them.
        """
        model = self.model
        if not self.overlapped:
            return None
        assert isinstance(model, StagedModel)
        size = len(items)
        args = (_within, deadline, model.prepare, items)
        value = await self.watchdog.call(self.host, "prepare", size, deadline, caught, *args)
        if isinstance(value, Raised):  # the whole run, in launch, finds the failing items
            return Prepared(items, error=value.exc)
        return Prepared(items, value)

    async def launch(
        self, items: list[Item], emit: Emit | None, deadline: float, prepared: Prepared | None
    ) -> Launched:
        """The batch's device work, in the model thread, in its :meth:`turn`: a staged
        model's work is queued (``prepared``, unless it was for other items or failed,
        is prepared again first); any other model runs whole, streaming to ``emit``."""
        assert self.model is not None
        args = (self.model, items, emit, deadline, prepared, self.overlapped)
        watch = (self.thread.executor, "launch", len(items), deadline)
        launched = await self.watchdog.call(*watch, _launch, *args)
        if launched.results is not None:
            self.last_run_s = launched.took_s
        return launched

    async def finish(self, launched: Launched) -> Ran:
        """The batch's results and model time: a staged model's wait for the device and
        its results are made in a host thread, after the turn (the next batch launches
        meanwhile); should that fail, the batch runs whole, split to find its failing
        items, in a turn of its own (and its time is no cost sample)."""
        if launched.results is not None:
            return Ran(launched.items, launched.results, launched.took_s, launched.cold)
        model = self.model
        assert isinstance(model, StagedModel)
        items, deadline = launched.items, launched.deadline
        args = (_results, deadline, model.finish, launched.value, items)
        got = await self.watchdog.call(self.host, "finish", len(items), deadline, caught, *args)
        if isinstance(got, Raised):
            if isinstance(got.exc, DeadlineExceeded):
                return Ran(items, [got.exc] * len(items), 0.0, launched.cold, costed=False)
            async with self.turn():
                again = (model, items, None, deadline)
                watch = (self.thread.executor, "rerun", len(items), deadline)
                rerun = await self.watchdog.call(*watch, _whole, *again)
            assert rerun.results is not None
            return Ran(items, rerun.results, rerun.took_s, rerun.cold, costed=False)
        results, done = got
        # Device time: from when it could start this batch (launched, and done with the
        # one before, of any stage on these weights) to done, so a wait behind the
        # previous batch is not this one's cost.
        thread = self.thread
        run_s = max(0.0, done - max(launched.started, thread.device_done))
        thread.device_done = max(thread.device_done, done)
        self.last_run_s = run_s
        return Ran(items, results, run_s, launched.cold)

    async def decoder(self) -> Decoder | None:
        """The model's running batch for continuous decoding (:mod:`workers.decoding`),
        made in the model thread, where the settings ask for it and the model offers
        one (a ``continuous_decoder(budget)`` method); else None: it runs in batches.
        The first is the one :meth:`load` made and warmed; each worker of a shared
        runner (a partition's) gets one of its own."""
        warm, self._warm = self._warm, None
        return warm if warm is not None else await self._decoder(warm=False)

    async def _decoder(self, *, warm: bool) -> Decoder | None:
        """A new running batch (see :meth:`decoder`); with ``warm``, every path a request
        can take has run once on it (:meth:`~workers.models.decoder.Decoder.warm_up`)."""
        make = getattr(self.model, "continuous_decoder", None)
        if self.settings.decoding != "continuous" or not callable(make):
            return None
        budget = self.settings.decode_token_budget
        try:
            made = cast("Decoder | None", await self._in(self.thread.executor, make, budget))
            if made is not None and warm:
                rows = self.settings.max_batch_size or self.stage.max_batch_size
                started = time.perf_counter()
                await self._in(self.thread.executor, made.warm_up, rows)
                took = time.perf_counter() - started
                logger.info("stage %s: continuous decoding warmed in %.2fs", self.stage.name, took)
        except Exception:  # batches still serve it: said, not fatal
            logger.exception("stage %s: no continuous decoding; batches serve it", self.stage.name)
            return None
        return made

    async def in_model(
        self, phase: str, size: int, deadline: float, fn: Callable[..., T], *args: Any
    ) -> T:
        """``fn(*args)`` in the model thread, in a :meth:`turn` of its own, watched like a
        batch of ``size`` items whose latest deadline is ``deadline``: what a model that
        is driven step by step (:mod:`workers.decoding`) runs for each step."""
        async with self.turn():
            return await self.watchdog.call(self.thread.executor, phase, size, deadline, fn, *args)

    def close(self) -> None:
        """Let the model thread go, unless another stage still runs in it (a batch still
        in it finishes on its own). Once: a second close must not count this runner off
        again, or the shared thread's users drop below zero, which reads as in use and
        hands the next stage on the same weights a thread already shut down."""
        if not self._closed:
            self._closed = True
            replays = getattr(getattr(self.model, "graphs", None), "replays", None)
            if isinstance(replays, int):  # bench.gpu reads it: were the rates graphs'?
                logger.info("stage %s: %d batches replayed CUDA graphs", self.stage.name, replays)
            self.thread.release()
            self.host.shutdown(wait=False)
            if isinstance(self.model, ItemwiseModel):
                self.model.close()

    @staticmethod
    async def _in(executor: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


def _within(deadline: float, fn: Callable[[Any], T], arg: Any) -> T:
    """``fn(arg)`` with the batch's deadline set for :func:`~pipelines.model.check_deadline`."""
    with batch_deadline(deadline):
        return fn(arg)


def _results(
    deadline: float, fn: Callable[[Any], object], arg: Any, items: list[Item]
) -> tuple[Results, float]:
    """:func:`_within`, its results held to the batch contract, and when it returned
    (``perf_counter``): the device's end, read in the thread that waited for it."""
    out = _within(deadline, fn, arg)
    done = time.perf_counter()
    return contract(items, out), done


def overlapped(model: object, staged: bool | None = None) -> bool:
    """Whether ``model``'s phases are run apart, overlapped across batches: a
    :class:`~pipelines.model.StagedModel` (``staged``, where the caller knows: the check
    is slow) that does not say ``overlapped = False`` (as a runner on the CPU does, whose
    device is the host: there its host work would only contend with its compute)."""
    staged = isinstance(model, StagedModel) if staged is None else staged
    return staged and bool(getattr(model, "overlapped", True))


def _same(a: list[Item], b: list[Item]) -> bool:
    """Whether two lists hold the same item objects (none withdrawn in between)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _launch(
    model: Model,
    items: list[Item],
    emit: Emit | None,
    deadline: float,
    prepared: Prepared | None,
    apart: bool,
) -> Launched:
    """The model thread's part of a batch (:meth:`Runner.launch`; ``apart``: overlapped)."""
    started = time.perf_counter()
    with batch_deadline(deadline), watching_cold() as cold:
        if apart and emit is None:
            model = cast(StagedModel, model)
            try:
                if prepared is None or prepared.error or not _same(prepared.items, items):
                    prepared = Prepared(items, model.prepare(items))
                value = model.launch(prepared.value)
                return Launched(items, deadline, started, cold(), value=value)
            except DeadlineExceeded as exc:
                return Launched(items, deadline, started, cold(), results=[exc] * len(items))
            except BaseException:  # whatever user code raises (SystemExit too)
                pass  # run whole below: a failing item fails alone
        return _whole(model, items, emit, deadline, started)


def _whole(
    model: Model,
    items: list[Item],
    emit: Emit | None,
    deadline: float,
    started: float | None = None,
) -> Launched:
    """The batch run whole in the model thread (:func:`whole_run`), done."""
    started = time.perf_counter() if started is None else started
    with batch_deadline(deadline), watching_cold() as cold:
        results = whole_run(model, items, emit)
    took = time.perf_counter() - started
    return Launched(items, deadline, started, cold(), results=results, took_s=took)
