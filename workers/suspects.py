"""Suspects run apart: the entries of a batch that crashed its worker run again in a
short-lived child process, forked from the worker with its model loaded, so an input
that kills its process kills the child, never the worker that serves everyone else.

A crash costs the worker one restart (the crash itself, which :mod:`workers.recovery`
charges to the batch on the model). The batch then runs again here: the child runs the
model on it (copy-on-write: no second load) and writes its results, encoded as JSON, to
a pipe, while the worker goes on reading and running other batches. A child that dies
(a signal, a non-zero exit) or runs past the stage's longest call (killed) held the
input that kills: its items run again in halves, each in a child of its own, until the
input is alone; it is then dead-lettered and its caller answered (500, or 504 for a call
that never returned), and every other item publishes its result.

A fork needs the model idle (no thread inside it, so no lock of its held in the child):
each child is forked in a turn of the model (:meth:`workers.runner.Runner.turn`), which
it leaves at once. The child runs only the model and writes to its pipe: it never
touches the worker's Redis connections or event loop, and ends with ``os._exit``.

Where a fork is not safe or not there, suspects run in the worker as before
(:meth:`Isolation.usable`): on an accelerator (CUDA cannot be forked), an itemwise model
(its items run apart already), no ``os.fork`` (Windows, macOS's spawn), or
``CONVEYOR_SUSPECTS_IN_CHILD=false``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import os
import signal
import struct
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from pipelines.envelope import sender
from pipelines.errors import (
    ERROR_STATUSES,
    Cancelled,
    ConveyorError,
    DeadlineExceeded,
    http_status,
)
from pipelines.model import Item, ItemwiseModel, Model, batch_deadline
from runtime.redisio import REDIS_DOWN
from workers.claims import deliveries
from workers.contract import checked
from workers.recovery import letter
from workers.route import Router, client_message
from workers.runner import Runner, whole_run
from workers.settings import WorkerSettings
from workers.values import Batch, Entry, Ran, Results, Turn, by_stream

logger = logging.getLogger(__name__)

HEADER = struct.Struct(">Q")
"""A child's answer on its pipe: its length (8 bytes), then the JSON results."""

PR_SET_PDEATHSIG = 1
"""``prctl``'s option: the signal a child gets when the worker that forked it dies."""


class Poisoned(ConveyorError):
    """An input that ended its model process (or whose call never returned) when run
    alone in a child: its entry is dead-lettered, its caller answered with this."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Relayed(ConveyorError):
    """A failure a child's model call returned for an item, as the child described it
    (its class cannot cross the pipe; its message, status and retry-after do)."""

    def __init__(self, message: str, status: int, retry_after: float | None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.status = status


@dataclass(frozen=True)
class Died:
    """A child that ended without its answer: how (``was killed by SIGKILL``), and
    whether it was killed for running past its bound (``hung``)."""

    how: str
    hung: bool = False


class Isolation:
    """Runs one worker's suspects in children of its process (see above).

    Args:
        runner: the stage's model runner (its model, its turns, its call bounds).
        router: names the stage and its dead-letter stream.
        client: Redis client (the deliveries of an input dead-lettered).
        consumer: this worker's consumer name.
        settings: the worker's settings (``suspects_in_child``).
    """

    def __init__(
        self,
        runner: Runner,
        router: Router,
        client: aioredis.Redis,
        consumer: str,
        settings: WorkerSettings,
    ) -> None:
        self.runner, self.router, self.client = runner, router, client
        self.consumer, self.settings = consumer, settings
        self.children = 0  # forked so far (tests, introspection)

    @property
    def usable(self) -> bool:
        """Whether suspects run in a child: the setting on, ``os.fork`` there (Linux),
        the model loaded, not itemwise, not on an accelerator, CUDA not started."""
        model = self.runner.model
        if not self.settings.suspects_in_child or not sys.platform.startswith("linux"):
            return False
        if model is None or isinstance(model, ItemwiseModel) or self.runner.accelerated:
            return False
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        return not (cuda is not None and cuda.is_initialized())

    async def run(self, batch: Batch, turn: Turn, deadline: float) -> Ran | None:
        """Run ``batch``'s live items in children (see above) and return what ran (None:
        nothing did); an input found to kill its process has its dead letter added to
        ``batch.letters`` and its caller's answer in its place among the results.

        Args:
            batch: the suspects' batch, opened by :meth:`workers.intake.Intake.open`.
            turn: the step's hooks: withdraws what was cancelled meanwhile.
            deadline: ``time.monotonic()`` of the batch's latest deadline.
        """
        if not batch.live:
            return None
        # Unmarked: their marks still say "queued for a re-run", so a crash of the worker
        # while a child runs them (another input's doing) is not charged to them.
        async with self.runner.turn():
            emitter = await turn.at_turn(batch, mark=False)
        if emitter is not None:
            await emitter.close()  # a child streams nothing: its final answer says it all
        if not batch.live:
            return None
        items = [item for _, item in batch.live]
        logger.info(
            "stage %s: %d suspects of a crash run again in a child process",
            self.router.stage,
            len(items),
        )
        started = time.perf_counter()
        results = await self._find(items, deadline)
        took = time.perf_counter() - started
        poisoned = [
            ((req.id, req.step), res)
            for (req, _), res in zip(batch.live, results, strict=True)
            if isinstance(res, Poisoned)
        ]
        if poisoned:
            await self._dead_letter(batch, poisoned)
        return Ran(items, results, took, cold=False, costed=False)

    async def _find(self, items: list[Item], deadline: float) -> Results:
        """``items``' results from a child; where it dies, from halves of them, each in
        a child of its own, down to the single input that kills (:class:`Poisoned`)."""
        got = await self._child(items, deadline)
        if not isinstance(got, Died):
            return got
        stage = self.router.stage
        if got.hung and time.monotonic() >= deadline:  # out of time: no half would run
            return [DeadlineExceeded("deadline passed while the step ran")] * len(items)
        if len(items) == 1:
            if got.hung:
                why = "its model call did not return within the stage's max_call_s"
                status = 504
            else:
                why = f"run alone, it ended its model process ({got.how})"
                status = 500
            message = f"{why}; dead-lettered: inspect with `conveyor dlq list {stage}`"
            return [Poisoned(message, status)]
        logger.warning(
            "stage %s: a child running %d suspects %s; running them again in halves",
            stage,
            len(items),
            got.how,
        )
        mid = len(items) // 2
        return await self._find(items[:mid], deadline) + await self._find(items[mid:], deadline)

    async def _child(self, items: list[Item], deadline: float) -> Results | Died:
        """``items`` run in a child of this process: their results, or how it died."""
        model = self.runner.model
        assert model is not None
        watchdog = self.runner.watchdog
        left = min(max(deadline - time.monotonic(), 0.0) + watchdog.grace_s, watchdog.max_call_s)
        async with self.runner.turn():  # the model idle while the process forks
            pid, fd = fork_running(model, items, deadline)
        self.children += 1
        try:
            status, data = await wait_child(pid, fd, left)
        finally:
            os.close(fd)
        if status is None:
            return Died(f"ran past its bound ({left:.1f} s) and was killed", hung=True)
        if status != 0:
            return Died(ended(status))
        try:
            return decode_results(data, len(items))
        except ValueError as exc:  # an exit 0 without its answer: user code exited
            return Died(f"exited without its results ({exc})")

    async def _dead_letter(
        self, batch: Batch, poisoned: list[tuple[tuple[str, str], Poisoned]]
    ) -> None:
        """Add the dead letters of the ``poisoned`` requests' entries (by request id and
        step: one request may have two entries here, two branches of a fan-out) to
        ``batch``."""
        stage = self.router.stage
        by_request: dict[tuple[str, str], Entry] = {}
        for entry in batch.entries:
            who = sender(entry.fields)
            if who is not None:
                by_request.setdefault((who.id, who.step), entry)
        found = [(by_request[rid], exc) for rid, exc in poisoned if rid in by_request]
        counts: dict[bytes, int] = {}
        try:
            for stream, ids in by_stream(e for e, _ in found).items():
                counts.update(await deliveries(self.client, stream, self.consumer, ids))
        except REDIS_DOWN as exc:  # the letter says less; it is written with the batch
            logger.warning("stage %s: deliveries unread: %s", stage, exc)
        for entry, why in found:
            fields = letter(entry.id, entry.fields, counts.get(entry.id, 2), str(why))
            batch.letters.append((self.router.keys.dead_letters(stage), fields))
            logger.error("stage %s: entry %r dead-lettered: %s", stage, entry.id, why)


def fork_running(model: Model, items: list[Item], deadline: float) -> tuple[int, int]:
    """Fork a child that runs ``model`` on ``items`` and writes their results to a pipe
    (:func:`encode_results`), then ends: its pid and the pipe's reading end."""
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12 warns of a fork with threads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: measured by its parent
        _child_main(model, items, deadline, read, write)
    os.close(write)
    return pid, read


def _child_main(model: Model, items: list[Item], deadline: float, read: int, write: int) -> None:
    """The child's whole life: the model on ``items``, its answer on ``write``, the end.
    Whatever happens, it never returns into the worker's code (``os._exit``)."""
    code = 3
    try:
        os.close(read)
        _alone()
        _one_thread()
        with batch_deadline(deadline):
            results = whole_run(model, items, None)
        data = encode_results(results)
        view = memoryview(HEADER.pack(len(data)) + data)
        while view:
            view = view[os.write(write, view) :]
        code = 0
    except BaseException:  # user code ends the child however it likes: exit 3 says so
        pass
    finally:
        os._exit(code)


def _one_thread() -> None:
    """torch at one thread in the child: a thread that ran a parallel op before the fork
    left OpenMP's pool behind in the parent, and a child that starts it again hangs."""
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            torch.set_num_threads(1)


def _alone() -> None:
    """Cut the child loose from the worker: a signal it gets is its own (not written to
    the worker's event loop), Ctrl-C and SIGTERM end it, and so does its worker's end."""
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, OSError):
            signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def encode_results(results: Results) -> bytes:
    """``results`` as JSON: ``{"ok": result}`` or ``{"error", "status", "kind",
    "retry_after"}`` each (a failure's class cannot cross a pipe; what its caller is told
    does)."""
    out: list[dict[str, Any]] = []
    for result in results:
        res = checked(result)
        if not isinstance(res, BaseException):
            out.append({"ok": res})
            continue
        kind = (
            "expired"
            if isinstance(res, DeadlineExceeded)
            else "cancelled"
            if isinstance(res, Cancelled)
            else "error"
        )
        retry = res.retry_after if isinstance(res, ConveyorError) else None
        out.append(
            {
                "error": client_message(res),
                "status": http_status(res),
                "kind": kind,
                "retry_after": retry if retry is None or math.isfinite(retry) else None,
            }
        )
    return orjson.dumps(out)


def decode_results(data: bytes, count: int) -> Results:
    """What :func:`encode_results` wrote for ``count`` items, framed by :data:`HEADER`.

    Raises:
        ValueError: ``data`` is not that (cut short, another count, another shape).
    """
    if len(data) < HEADER.size or HEADER.unpack_from(data)[0] != len(data) - HEADER.size:
        raise ValueError(f"{len(data)} bytes, not a whole answer")
    got = orjson.loads(data[HEADER.size :])
    if not isinstance(got, list) or len(got) != count:
        raise ValueError(f"not {count} results")
    results: Results = []
    for one in got:
        if isinstance(one, dict) and isinstance(one.get("ok"), dict):
            results.append(one["ok"])
            continue
        if not isinstance(one, dict) or not isinstance(one.get("error"), str):
            raise ValueError("a result of another shape")
        message, kind, status = one["error"], one.get("kind"), one.get("status")
        retry = one.get("retry_after")
        if kind == "expired":
            results.append(DeadlineExceeded(message))
        elif kind == "cancelled":
            results.append(Cancelled(message))
        else:
            status = status if isinstance(status, int) and status in ERROR_STATUSES else 500
            retry = float(retry) if isinstance(retry, int | float) and retry >= 0 else None
            results.append(Relayed(message, status, retry))
    return results


async def wait_child(pid: int, fd: int, limit_s: float) -> tuple[int | None, bytes]:
    """Wait (without holding the event loop) for child ``pid`` to end, reading what it
    writes to ``fd`` meanwhile (a full pipe would stop it); past ``limit_s`` it is killed.

    Returns:
        Its wait status (None: killed past the limit) and all it wrote.
    """
    loop = asyncio.get_running_loop()
    buf = bytearray()
    os.set_blocking(fd, False)

    def drain() -> None:
        try:
            while chunk := os.read(fd, 1 << 16):
                buf.extend(chunk)
        except (BlockingIOError, InterruptedError):
            return
        loop.remove_reader(fd)  # its end of file: no writer is left

    loop.add_reader(fd, drain)
    try:
        async with asyncio.timeout(limit_s):
            status = await _ended(pid)
    except BaseException as exc:  # past the limit, or the worker stops: the child goes
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        reap(pid)  # killed: at once
        if not isinstance(exc, TimeoutError):
            raise
        return None, bytes(buf)
    finally:
        loop.remove_reader(fd)
    drain()  # what it wrote just before it ended (the pipe holds it)
    return status, bytes(buf)


async def _ended(pid: int) -> int:
    """The wait status of child ``pid`` once it has ended (then reaped)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (Linux before 5.3): waited in a thread
        return await asyncio.to_thread(reap, pid)
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return reap(pid)  # it has ended: no wait


def reap(pid: int) -> int:
    """The wait status of child ``pid``, once it has ended (reaped). One reaped by
    another reads 0: its answer, if whole, says how it went."""
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return 0


def ended(status: int) -> str:
    """How a child with wait ``status`` ended, in words."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"was killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"was killed by signal {sig}"
    return f"exited ({os.waitstatus_to_exitcode(status)})"
