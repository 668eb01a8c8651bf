"""An itemwise model's batch (a function step's): each item a call of its own, run beside
every other batch, never in a turn on the model thread, so one slow call holds only its
own item. :meth:`workers.runner.Runner.run` hands such a batch here."""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import Future
from dataclasses import dataclass

from pipelines.errors import Cancelled, DeadlineExceeded
from pipelines.model import ItemwiseModel, Result
from workers.modelthread import hung
from workers.values import Batch, Ran, Turn

CHECK_S = 1.0
"""How often the requests of calls still running are checked for cancellation (one GET,
or MGET, per batch), from the first second of their run on."""


@dataclass
class Apart:
    """Runs an itemwise model's batches.

    Attributes:
        stage: the stage's name (said when a call hangs).
        grace_s: how long an abandoned call may run past its deadline before the worker
            is taken for hung (``hung_grace_s``).
    """

    stage: str
    grace_s: float

    async def run(
        self, model: ItemwiseModel, batch: Batch, turn: Turn, deadline: float
    ) -> Ran | None:
        """Run ``batch`` (one item, but for reclaimed suspects); None when nothing ran.

        Its entries are marked on the model and its cancelled requests withdrawn
        (``turn.at_turn``, one round trip) before any call starts; each item is then a
        call of its own (``model.submit``). A call still running is asked every
        :data:`CHECK_S` whether its request was cancelled (``turn.cancelled``: one round
        trip for the batch); if so it is abandoned and its item ends cancelled
        (:class:`~pipelines.errors.Cancelled`, still counted as model work); at
        ``deadline`` it is abandoned and its item expires. An abandoned call is asked to
        stop (``model.cancel``: an async one is cancelled; a sync one runs on, its result
        dropped); one still running ``grace_s`` past ``deadline`` ends the worker
        (:func:`~workers.modelthread.hung`), as a model call would: its thread is lost.

        Args:
            model: the stage's model.
            batch: the batch opened by :meth:`workers.intake.Intake.open`.
            turn: the step's hooks.
            deadline: ``time.monotonic()`` of the batch's latest deadline (its one
                request's, but for suspects).
        """
        emitter = await turn.at_turn(batch, mark=True)
        if emitter is not None:
            await emitter.close()  # a call of one item streams nothing
        if not batch.live:
            return None
        started, since = time.perf_counter(), time.monotonic()
        calls = {req.id: model.submit(item, deadline) for req, item in batch.live}
        waits = {asyncio.wrap_future(call): rid for rid, call in calls.items()}
        ended: dict[str, Result | BaseException] = {}
        check_at = since + CHECK_S
        try:
            while waits:
                timeout = max(0.0, min(check_at, deadline) - time.monotonic())
                done, _ = await asyncio.wait(waits, timeout=timeout)
                for future in done:
                    ended[waits.pop(future)] = future.result()
                now = time.monotonic()
                if waits and now >= deadline:
                    for rid in waits.values():
                        ended[rid] = DeadlineExceeded("the step ran past its deadline; stopped")
                    break
                if waits and now >= check_at:
                    check_at = now + CHECK_S
                    found = await turn.cancelled(list(waits.values()))
                    for future, rid in list(waits.items()):
                        if rid in found:  # ends cancelled; its call is dropped
                            ended[rid] = Cancelled("cancelled while the step ran")
                            self._abandon(model, calls[rid], future, since, deadline)
                            del waits[future]
        finally:  # at the deadline, or the worker stops
            for future, rid in waits.items():
                self._abandon(model, calls[rid], future, since, deadline)
        took = time.perf_counter() - started
        results = [ended[req.id] for req, _ in batch.live]
        cut = any(isinstance(r, DeadlineExceeded | Cancelled) for r in results)  # no cost
        return Ran([item for _, item in batch.live], results, took, cold=False, costed=not cut)

    def _abandon(
        self,
        model: ItemwiseModel,
        call: Future[Result | BaseException],
        waiting: asyncio.Future[Result | BaseException],
        since: float,
        deadline: float,
    ) -> None:
        """Nobody waits for ``call`` (``waiting``, in this loop) any more: ask it to stop;
        should it still run ``grace_s`` past ``deadline`` (or past now, if later), the
        worker is hung. ``since``: ``time.monotonic()`` when it was submitted."""
        waiting.cancel()
        model.cancel(call)
        if call.done():
            return
        loop = asyncio.get_running_loop()
        limit = max(deadline - time.monotonic(), 0.0) + self.grace_s
        stage = self.stage

        def check() -> None:
            if not call.done():
                hung(stage, "call", 1, time.monotonic() - since)

        timer = loop.call_later(limit, check)

        def cancel_timer(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the worker's loop is closed
                loop.call_soon_threadsafe(timer.cancel)

        call.add_done_callback(cancel_timer)
