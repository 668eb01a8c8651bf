"""The stage's model, the thread it runs in, and the phases a batch goes through on it.

The run step of a batch is :meth:`Runner.run`'s, the worker's one call: prepared, its
turn taken, the requests cancelled meanwhile withdrawn, launched (partial output streamed
as it comes), finished, and what it cost learned by the window.

A batch runs on the model in its turn (:meth:`Runner.turn`), one batch at a time. A
:class:`~pipelines.model.StagedModel` (a model for an accelerator) splits its call so the
device never waits on the host: :meth:`Runner.prepare` tokenizes batch n+1 in a host
thread before its turn, while batch n is on the device; in the turn, :meth:`Runner.launch`
only queues the device's work; :meth:`Runner.finish` waits for it (a wait that releases
the GIL) and makes the results in a host thread after the turn, while the next batch
launches. Any other model runs whole in :meth:`Runner.launch`.

Whatever user code raises in these threads fails its items, never the worker; a call
still running ``hung_grace_s`` past every deadline of its batch ends the process
(:func:`hung`), since the thread it holds can never be freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
import weakref
from collections.abc import AsyncIterator, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

import redis.asyncio as aioredis

from pipelines.errors import DeadlineExceeded
from pipelines.keys import Keys
from pipelines.model import (
    Item,
    Model,
    Result,
    StagedModel,
    StreamingModel,
    batch_deadline,
    watching_cold,
)
from pipelines.stages import Stage
from runtime.redisio import RedisClock
from workers.batch import Batch, Breaches, contract, noting, run_isolating
from workers.build import build_model, prepare_shapes
from workers.crashes import mark_now
from workers.intake import Intake
from workers.lengths import account, input_cap
from workers.partials import Partials
from workers.settings import WorkerSettings
from workers.window import Window

if TYPE_CHECKING:  # torch is imported by the models that decode, not by every worker
    from workers.models.decoder import Decoder

logger = logging.getLogger(__name__)

T = TypeVar("T")

HUNG_EXIT = 70
"""The exit status of a worker whose model call hung (:func:`hung`): not 2 or 3, which
``up`` reads as a configuration error or a taken port, so it is restarted as any crash
(70 is ``EX_SOFTWARE``)."""

Emit = Callable[[int, str], None]
"""Streamed output from the model thread: row ``index`` now reads ``text``."""

Results = list[Result | BaseException]


def whole_run(model: Model, items: list[Item], emit: Emit | None) -> Results:
    """Run the batch in one call (see :func:`~workers.batch.run_isolating`), streaming
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


@dataclass
class Ran:
    """A batch's results, its model time, whether it met a cold shape (then its time is
    not the model's cost, :func:`~pipelines.model.cold_shape`) and whether its time is a
    cost sample at all (not when it was cut short or run again to isolate a failure)."""

    results: Results
    run_s: float
    cold: bool
    costed: bool = True

    @property
    def sample(self) -> bool:
        """Whether the batch's time is what the model costs (what the window learns)."""
        return self.costed and not self.cold


@dataclass
class Seat:
    """One worker's place at its stage's runner (the workers of a stage's partitions share
    one, :func:`workers.partitions.partition_workers`): what :meth:`Runner.run` needs of
    that worker.

    Attributes:
        client: its Redis client.
        keys: its partition's key names.
        settings: its settings (partials' reply stream cap).
        clock: the server's clock.
        intake: withdraws the requests cancelled before the batch's turn.
        window: learns what a batch costs.
        length_aware: the stage batches by length (its cost is learned on padded tokens).
    """

    client: aioredis.Redis
    keys: Keys
    settings: WorkerSettings
    clock: RedisClock
    intake: Intake
    window: Window
    length_aware: bool


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
        self.device_done = 0.0  # perf_counter when the device last finished a batch

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
        self.thread = ModelThread(stage.name)
        # Two: one batch's preparation beside another's wait for the device.
        self.host = ThreadPoolExecutor(2, thread_name_prefix=f"host-{stage.name}")
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

    async def run(self, batch: Batch, seat: Seat) -> None:
        """Run ``batch``'s live items on the model (its results and model time in it),
        streaming partial output as it comes.

        A staged model prepares the batch before its turn, beside the batch on the
        device. Once the model is the batch's (its turn), the requests cancelled while it
        waited are withdrawn and never run (one round trip, which also marks its entries
        on the model: workers/crashes.py); its results are made after the turn, while the
        next batch launches. Its tokens are noted in its record and, unless it met a cold
        shape or was cut short, its cost is learned by the window.

        Args:
            batch: the batch opened by :meth:`workers.intake.Intake.open`.
            seat: the worker's place at this runner.
        """
        if not batch.live:
            return
        partials: Partials | None = None
        clock = seat.clock
        deadline = clock.monotonic(max(r.deadline for r, _ in batch.live))
        try:
            staged = overlapped(self.model)
            if staged:  # its host phase runs user code before its turn
                await mark_now(seat.client, seat.keys, batch.entries)
            prepared = await self.prepare([item for _, item in batch.live], deadline)
            async with self.turn():
                # Marked on the model (workers/crashes.py) in the same round trip.
                await seat.intake.withdraw_cancelled(batch, clock.now(), mark=not staged)
                if not batch.live:
                    return
                requests = [req for req, _ in batch.live]
                loop = asyncio.get_running_loop()
                partials = Partials(seat.client, requests, seat.settings, loop, seat.keys)
                items = [item for _, item in batch.live]
                emit = partials.emit if partials.wanted else None
                launched = await self.launch(items, emit, deadline, prepared)
            ran = await self.finish(launched)
            batch.results, batch.record.run_s = ran.results, ran.run_s
            for result in ran.results:  # said and counted, then failed alone (route.py)
                if not isinstance(result, dict | BaseException):
                    self.breaches.note(f"a result is {type(result).__name__}")
            batch.record.cold = ran.cold
            batch.record.ran_at = clock.now()
        finally:
            if partials is not None:
                await partials.close()  # every partial is out before the final reply
        padded = account(batch.record, items, input_cap(self.model))
        if ran.sample:  # a cold shape's first call is not the model's cost
            units = padded if seat.length_aware else len(items)
            seat.window.learn(len(items), units, batch.record.run_s)

    async def prepare(self, items: list[Item], deadline: float) -> Prepared | None:
        """A staged model's host phase for ``items``, in a host thread (before the
        batch's turn, beside the device's work on another); None for any other model.

        Args:
            items: the batch's items.
            deadline: ``time.monotonic()`` past which nobody waits for any of them.
        """
        model = self.model
        if not overlapped(model):
            return None
        assert isinstance(model, StagedModel)
        size = len(items)
        args = (_within, deadline, model.prepare, items)
        value = await self._watched(self.host, "prepare", size, deadline, _caught, *args)
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
        args = (self.model, items, emit, deadline, prepared)
        executor = self.thread.executor
        launched = await self._watched(executor, "launch", len(items), deadline, _launch, *args)
        if launched.results is not None:
            self.last_run_s = launched.took_s
        return launched

    async def finish(self, launched: Launched) -> Ran:
        """The batch's results and model time: a staged model's wait for the device and
        its results are made in a host thread, after the turn (the next batch launches
        meanwhile); should that fail, the batch runs whole, split to find its failing
        items, in a turn of its own (and its time is no cost sample)."""
        if launched.results is not None:
            return Ran(launched.results, launched.took_s, launched.cold)
        model = self.model
        assert isinstance(model, StagedModel)
        items, deadline = launched.items, launched.deadline
        args = (_results, deadline, model.finish, launched.value, items)
        got = await self._watched(self.host, "finish", len(items), deadline, _caught, *args)
        if isinstance(got, Raised):
            if isinstance(got.exc, DeadlineExceeded):
                return Ran([got.exc] * len(items), 0.0, launched.cold, costed=False)
            async with self.turn():
                again = (model, items, None, deadline)
                executor = self.thread.executor
                rerun = await self._watched(executor, "rerun", len(items), deadline, _whole, *again)
            assert rerun.results is not None
            return Ran(rerun.results, rerun.took_s, rerun.cold, costed=False)
        results, done = got
        # Device time: from when it could start this batch (launched, and done with the
        # one before, of any stage on these weights) to done, so a wait behind the
        # previous batch is not this one's cost.
        thread = self.thread
        run_s = max(0.0, done - max(launched.started, thread.device_done))
        thread.device_done = max(thread.device_done, done)
        self.last_run_s = run_s
        return Ran(results, run_s, launched.cold)

    async def decoder(self) -> Decoder | None:
        """The model's running batch for continuous decoding (:mod:`workers.decoding`),
        made in the model thread, where the settings ask for it and the model offers
        one (a ``continuous_decoder(budget)`` method); else None: it runs in batches."""
        make = getattr(self.model, "continuous_decoder", None)
        if self.settings.decoding != "continuous" or not callable(make):
            return None
        budget = self.settings.decode_token_budget
        try:
            made = await self._in(self.thread.executor, make, budget)
        except Exception:  # batches still serve it: said, not fatal
            logger.exception("stage %s: no continuous decoding; batches serve it", self.stage.name)
            return None
        return cast("Decoder | None", made)

    async def in_model(
        self, phase: str, size: int, deadline: float, fn: Callable[..., T], *args: Any
    ) -> T:
        """``fn(*args)`` in the model thread, in a :meth:`turn` of its own, watched like a
        batch of ``size`` items whose latest deadline is ``deadline``: what a model that
        is driven step by step (:mod:`workers.decoding`) runs for each step."""
        async with self.turn():
            return await self._watched(self.thread.executor, phase, size, deadline, fn, *args)

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

    @staticmethod
    async def _in(executor: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    async def _watched(
        self,
        executor: ThreadPoolExecutor,
        phase: str,
        size: int,
        deadline: float,
        fn: Callable[..., T],
        *args: Any,
    ) -> T:
        """``fn(*args)`` in ``executor``, a phase of a batch of ``size`` items whose
        latest deadline is ``deadline``: should it still run ``hung_grace_s`` past that
        (or past its start, if later), it is hung (:func:`hung`). A thread cannot be
        stopped, and the model's stays taken: no later batch could run."""
        call = executor.submit(noting, self.breaches, fn, *args)
        future = asyncio.wrap_future(call)
        started = time.monotonic()
        limit = max(deadline - started, 0.0) + self.settings.hung_grace_s
        try:
            await asyncio.wait((future,), timeout=limit)
        except asyncio.CancelledError:
            future.cancel()  # the worker stops: a call not started yet never runs
            raise
        # The call itself, not its news in this loop: a process paused past the limit
        # (SIGSTOP, a VM's pause) finds its call returned, and its timer due first.
        if not call.done():
            hung(self.stage.name, phase, size, time.monotonic() - started)
        return await future


def hung(stage: str, phase: str, size: int, ran_s: float) -> NoReturn:
    """End the process: a model call of ``stage`` ran past every deadline of its batch
    and the grace after them. One ERROR line says so (the stage, the phase, the batch's
    size and how long it ran), the logs are flushed, and the process exits with
    :data:`HUNG_EXIT` at once (``os._exit``: the stuck thread cannot be joined, and an
    orderly exit would wait for it). Its liveness file (:mod:`workers.alive`) is touched
    no more; its batch's entries stay pending, for recovery to reclaim; ``up`` restarts
    it as any crash.

    Args:
        stage: the stage served.
        phase: the call that hung (``prepare``, ``launch``, ``finish``, ``rerun``).
        size: the items of its batch.
        ran_s: how long the call had run.
    """
    logger.error(
        "stage %s: a batch of %d hung in its model call (%s): %.1f s without returning, "
        "past every deadline of the batch; exiting with status %d to be restarted",
        stage,
        size,
        phase,
        ran_s,
        HUNG_EXIT,
    )
    logging.shutdown()  # flushes every handler
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(HUNG_EXIT)


@dataclass
class Raised:
    """What user code raised in a thread, carried back as a value: raised across into the
    event loop, a ``SystemExit`` or ``KeyboardInterrupt`` would end the worker and a
    ``CancelledError`` would read as the awaiting task's own cancellation."""

    exc: BaseException


def _caught(fn: Callable[..., T], *args: Any) -> T | Raised:
    """``fn(*args)``, or what it raised (:class:`Raised`)."""
    try:
        return fn(*args)
    except BaseException as exc:  # user code: whatever it raises is its batch's failure
        return Raised(exc)


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


def overlapped(model: object) -> bool:
    """Whether ``model``'s phases are run apart, overlapped across batches: a
    :class:`~pipelines.model.StagedModel` that does not say ``overlapped = False`` (as a
    runner on the CPU does, whose device is the host: there its host work would only
    contend with its compute for the same cores)."""
    return isinstance(model, StagedModel) and bool(getattr(model, "overlapped", True))


def _same(a: list[Item], b: list[Item]) -> bool:
    """Whether two lists hold the same item objects (none withdrawn in between)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _launch(
    model: Model,
    items: list[Item],
    emit: Emit | None,
    deadline: float,
    prepared: Prepared | None,
) -> Launched:
    """The model thread's part of a batch (see :meth:`Runner.launch`)."""
    started = time.perf_counter()
    with batch_deadline(deadline), watching_cold() as cold:
        if overlapped(model) and emit is None:
            assert isinstance(model, StagedModel)
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
