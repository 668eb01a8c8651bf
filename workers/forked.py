"""A child process forked from a worker to run its model on a few items: the fork, the
child's whole life (the model, its answer on a pipe, ``os._exit``), the answer's encoding
(JSON, framed; no pickle) and the parent's wait for it. Used by :mod:`workers.suspects`.
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
import warnings
from typing import Any

import orjson

from pipelines.errors import (
    ERROR_STATUSES,
    Cancelled,
    ConveyorError,
    DeadlineExceeded,
    http_status,
)
from pipelines.model import Item, Model, batch_deadline
from workers.contract import checked
from workers.route import client_message
from workers.runner import whole_run
from workers.values import Results

logger = logging.getLogger(__name__)

HEADER = struct.Struct(">Q")
"""A child's answer on its pipe: its length (8 bytes), then the JSON results."""

PR_SET_PDEATHSIG = 1
"""``prctl``'s option: the signal a child gets when the worker that forked it dies."""


class Relayed(ConveyorError):
    """A failure a child's model call returned for an item, as the child described it
    (its class cannot cross the pipe; its message, status and retry-after do)."""

    def __init__(self, message: str, status: int, retry_after: float | None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.status = status


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
