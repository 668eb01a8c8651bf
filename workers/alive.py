"""The worker's liveness file: touched each time its read loop comes round.

A worker has no HTTP port; what a supervisor (Kubernetes, Docker) can see of it is a
file. The loop touches ``CONVEYOR_ALIVE_FILE`` after every read (at least every
``CONVEYOR_BLOCK_MS`` while idle) and whenever a batch frees a slot for the next read, so
a file older than the longest batch plus a margin means the loop has stopped coming
round: a model call that never returns, an event loop blocked, a deadlock. (A model
call past every deadline of its batch by ``CONVEYOR_HUNG_GRACE_S`` ends the worker
itself: :func:`workers.runner.hung`.) The probe
is a shell one-liner (no Python start per probe)::

    test $(( $(date +%s) - $(stat -c %Y "$CONVEYOR_ALIVE_FILE") )) -lt 120

The file first appears once the model is loaded and the loop reads, so a start-up probe
with a generous budget covers the load and the liveness probe takes over after it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)

INTERVAL_S = 1.0
"""Touch at most this often (a touch is a syscall; the loop comes round far more)."""


class AliveFile:
    """Touches ``path`` (when set) at most every :data:`INTERVAL_S`.

    Args:
        path: the file (its folder must exist and be writable); None: do nothing.
    """

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self._last = float("-inf")

    def beat(self) -> None:
        """The loop came round: refresh the file's modification time."""
        if self.path is None:
            return
        now = time.monotonic()
        if now - self._last < INTERVAL_S:
            return
        self._last = now
        try:
            self.path.touch()  # sets the modification time of one that exists
        except OSError as exc:  # a full or read-only disk must not stop the work
            logger.warning("could not touch the liveness file %s: %s", self.path, exc)
