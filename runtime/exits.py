"""What a child of ``conveyor up`` tells it on a pipe of its own: why it exits when no
restart would mend it, and that it made progress before it died.

``up`` gives each child it starts the write end of a pipe (:data:`EXIT_REPORT_FD`, read by
:class:`conveyor.children.ExitReports`). An exit status alone cannot be believed: a
user's code can exit 2 (``sys.exit(2)``, ``os._exit(2)``), and that is a crash to
restart, never a reason to stop the whole service. So a configuration error is said on
the pipe before the status (:func:`exit_for`). And a worker that dies after it did some
work (published a batch or a dead letter, charged a crash to the inputs on a dead
worker's model) said so first (:func:`progressed`): that crash is no loop.

Outside ``up`` (a container, a test) there is no pipe and both only exit or do nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from pipelines.errors import ConfigError

EXIT_REPORT_FD = "CONVEYOR_EXIT_REPORT_FD"
"""Not a setting: the variable ``conveyor up`` gives each child it starts, naming the
write end of its pipe."""

PROGRESS = b"+"
"""What :func:`progressed` writes, once, before anything :func:`exit_for` writes."""

_said_progress = False


def _write(data: bytes) -> None:
    raw = os.environ.get(EXIT_REPORT_FD, "")
    if raw.isdigit():
        # An OSError: not up's child after all (a stale variable); nothing to tell.
        with contextlib.suppress(OSError):
            os.write(int(raw), data)


def exit_for(code: int, why: str) -> NoReturn:
    """End this process with ``code`` for a reason no restart mends (2: a configuration
    error; 3: the gateway's port), saying ``why`` on the pipe ``conveyor up`` gave it."""
    _write(why.encode("utf-8", "replace")[:4096] or b"?")
    raise SystemExit(code)


def progressed() -> None:
    """Tell ``up`` that this process did some work (once; later calls cost nothing)."""
    global _said_progress
    if not _said_progress:
        _said_progress = True
        _write(PROGRESS)


@contextmanager
def exit_on_config_error() -> Iterator[None]:
    """Around an entry point's start: a :class:`ConfigError` (a bad setting, argument or
    stage) ends the process with its message on one line and exit status 2, as a usage
    error does, instead of a traceback; told to ``conveyor up`` too (:func:`exit_for`)."""
    try:
        yield
    except ConfigError as exc:
        print(f"conveyor: {exc}", file=sys.stderr, flush=True)
        exit_for(2, str(exc))
