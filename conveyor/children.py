"""How ``conveyor up`` starts a child process (in a process group of its own, and bound
to die with ``up``) and stops one (:func:`terminate`), and how ``up`` speaks beside them
on the terminal they share (:func:`say`).

Its own process group: a terminal's Ctrl-C reaches ``up`` alone, which stops its
children in order (see :mod:`conveyor.supervisor`).

Dying with ``up``: an orderly stop stops every child, but ``up`` killed (SIGKILL, the
OOM killer, a crash of the interpreter) runs no code at all, and its children, an
embedded redis-server among them, would live on as orphans. On Linux each child asks
the kernel, between fork and exec, for SIGKILL when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), so nothing of ``up`` can outlive it, whatever ends it.
Chosen over a watchdog pipe the children read: that needs code in every child, and
redis-server runs none of ours. Two things to know:

- The "parent" is the thread that started the child: ``up`` starts every child from
  its main thread, which lives as long as ``up`` (a child started from a thread that
  ends is killed with it).
- ``up`` dying between the fork and the ``prctl`` would be missed, so the child checks
  that its parent is still the one that forked it, and kills itself if not.

Elsewhere than Linux the children are started without it (an orderly stop still
stops them).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from runtime.exits import EXIT_REPORT_FD, PROGRESS

PR_SET_PDEATHSIG = 1
"""``prctl``'s option: the signal the calling process gets when its parent dies."""

STOP_GRACE_S = 15.0
"""A process still running this long after SIGTERM is killed (a gateway: this long after
its drain, ``CONVEYOR_DRAIN_S``)."""

Process = subprocess.Popen[bytes]


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, looked up before any fork (the child must not load anything);
    None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        found: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return found


_PRCTL = _prctl()


def bound_to_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when this process dies (None
    where the platform cannot; see the module's docstring).

    It runs in the forked child before exec: it only calls ``prctl`` and ``getppid``,
    no import, no lock another thread could hold.
    """
    prctl = _PRCTL
    if prctl is None:
        return None
    parent = os.getpid()

    def bind() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return bind


def child_options(*, bound: bool = True) -> dict[str, Any]:
    """``subprocess.Popen`` keyword arguments for a child of ``up``: its own process
    group and, if ``bound``, death with this process (:func:`bound_to_parent`).

    Args:
        bound: bind the child's life to this process's.
    """
    options: dict[str, Any] = {"process_group": 0}
    bind = bound_to_parent() if bound else None
    if bind is not None:
        options["preexec_fn"] = bind
    return options


class Exit(NamedTuple):
    """What a child said on its pipe before it exited (:mod:`runtime.exits`).

    Attributes:
        progressed: it did some work (published, or charged a crash to its inputs).
        reason: why no restart would mend it (a configuration error), or None.
    """

    progressed: bool = False
    reason: str | None = None


class ExitReports:
    """Each child's pipe, on which it says why it exits when no restart would mend it,
    and whether it made progress (:mod:`runtime.exits`).

    Its exit status alone cannot be believed: a user's code can exit 2 (``sys.exit(2)``,
    ``os._exit(2)``), and that is a crash, restarted, never a reason to stop the whole
    service.
    """

    def __init__(self) -> None:
        self._pipes: dict[int, int] = {}  # pid: the read end of its pipe
        self._kept: dict[int, Exit] = {}  # pid: what it said, read before it was asked

    def start(self, args: list[str], env: dict[str, str]) -> Process:
        """Start ``args`` with ``env`` as a child of ``up`` (:func:`child_options`), a
        report pipe of its own given."""
        read, write = os.pipe()
        os.set_blocking(read, False)
        try:
            proc = subprocess.Popen(
                args, env=env | {EXIT_REPORT_FD: str(write)}, pass_fds=(write,), **child_options()
            )
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        self._pipes[proc.pid] = read
        return proc

    def said(self, proc: Process, *, keep: bool = False) -> Exit:
        """What ``proc`` (exited) said; its pipe is closed. With ``keep``, it is also kept
        for the next call (read early, asked later)."""
        read = self._pipes.pop(proc.pid, None)
        if read is None:
            return self._kept.pop(proc.pid, Exit())
        chunks = []
        try:
            while chunk := os.read(read, 65536):  # what it wrote, up to its end (EOF)
                chunks.append(chunk)
        except BlockingIOError:
            pass  # its end still open (a grandchild holds it): what is there is all
        finally:
            os.close(read)
        raw = b"".join(chunks)
        progressed = raw.startswith(PROGRESS)
        text = raw.removeprefix(PROGRESS).decode("utf-8", "replace")
        said = Exit(progressed, text or None)
        if keep and said != Exit():
            self._kept[proc.pid] = said
        return said

    def close(self) -> None:
        """Close every pipe left (``up`` stops)."""
        for read in self._pipes.values():
            os.close(read)
        self._pipes.clear()


def terminate(procs: list[tuple[str, Process]], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to each of ``procs`` (named) still running; wait for all, killing what is
    still running after ``grace_s``."""
    for _, proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for name, proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            say(f"{name} did not stop within {grace_s:g}s; killed")
            proc.kill()
            proc.wait()


def say(line: str) -> None:
    """Print one line of ``up``'s own, flushed (its children print to the same terminal)."""
    print(f"conveyor: {line}", flush=True)
