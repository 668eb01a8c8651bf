"""The one thread a loaded model runs in, the turns batches take on it, and the watchdog
that ends a process whose model call never returns (a thread cannot be stopped)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sys
import time
import weakref
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from workers.contract import Breaches, noting

logger = logging.getLogger(__name__)

T = TypeVar("T")

HUNG_EXIT = 70
"""The exit status of a worker whose model call hung (:func:`hung`): not 2 or 3, which
``up`` reads as a configuration error or a taken port, so it is restarted as any crash
(70 is ``EX_SOFTWARE``)."""


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


@dataclass
class Watchdog:
    """Watches one stage's model calls (see :meth:`call`).

    Attributes:
        stage: the stage's name.
        grace_s: how long a call may run past its batch's latest deadline.
        breaches: where the calls note their contract breaches.
        max_call_s: the longest any call may run, whatever its batch's deadlines (the
            stage's bound: a job's hour-long deadline must not hold the stage an hour).
    """

    stage: str
    grace_s: float
    breaches: Breaches
    max_call_s: float = math.inf

    async def call(
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
        (or past its start, if later), or :attr:`max_call_s` in all, it is hung
        (:class:`Hung` is raised). A thread cannot be stopped, and the model's stays
        taken: no later batch could run.

        Only the time the process ran counts: the call is looked at every second, and
        a look that comes late (the process was paused: SIGSTOP, a VM's pause, a laptop's
        sleep) counts a second, so a paused healthy worker is not taken for hung."""
        call = executor.submit(noting, self.breaches, fn, *args)
        future = asyncio.wrap_future(call)
        started = time.monotonic()
        left = min(max(deadline - started, 0.0) + self.grace_s, self.max_call_s)
        try:
            while not call.done() and left > 0:
                look = min(LOOK_S, left)
                before = time.monotonic()
                await asyncio.wait((future,), timeout=look)
                left -= min(time.monotonic() - before, look + LATE_LOOK_S)
        except asyncio.CancelledError:
            future.cancel()  # the worker stops: a call not started yet never runs
            raise
        # The call itself, not its news in this loop: a process paused past the limit
        # (SIGSTOP, a VM's pause) finds its call returned, and its timer due first.
        if not call.done():
            raise Hung(self.stage, phase, size, time.monotonic() - started)
        return await future


LOOK_S = 1.0
"""How often a running model call is looked at."""

LATE_LOOK_S = 0.5
"""A look this much later than asked was a pause of the process, not the call's time."""


class Hung(BaseException):
    """A model call ran past its bound (:meth:`Watchdog.call`); its thread is lost. A
    :class:`BaseException`, so no handler of a model's failures takes it for one: the
    step that ran the batch notes it, then :meth:`exit` ends the process.

    Args:
        stage: the stage served.
        phase: the call that hung (``prepare``, ``launch``, ``finish``, ``rerun``, ...).
        size: the items of its batch.
        ran_s: how long the call had run.
    """

    def __init__(self, stage: str, phase: str, size: int, ran_s: float) -> None:
        super().__init__(f"stage {stage}: a batch of {size} hung in its model call ({phase})")
        self.stage, self.phase, self.size, self.ran_s = stage, phase, size, ran_s

    def exit(self) -> NoReturn:
        """End the process (:func:`hung`)."""
        hung(self.stage, self.phase, self.size, self.ran_s)


def hung(stage: str, phase: str, size: int, ran_s: float) -> NoReturn:
    """End the process: a model call of ``stage`` ran past its bound (every deadline of
    its batch and the grace after them, or the stage's longest call). One ERROR line says
    so (the stage, the phase, the batch's size and how long it ran), the logs are flushed,
    and the process exits with
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
        "past its bound; exiting with status %d to be restarted",
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


def caught(fn: Callable[..., T], *args: Any) -> T | Raised:
    """``fn(*args)``, or what it raised (:class:`Raised`)."""
    try:
        return fn(*args)
    except BaseException as exc:  # user code: whatever it raises is its batch's failure
        return Raised(exc)
