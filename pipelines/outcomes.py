"""How a request ended, and everything that follows from it.

An :class:`Outcome` is what a final reply says (``Reply.outcome`` on the wire), and it
knows the three things the rest of conveyor derives from it: the HTTP status the request
is answered with, the status its async job's record takes (:data:`JobStatus`, also
here), and the stats-hash field that counts it (``items:<outcome>``, read by
``/metrics``, ``/status`` and the history). Nobody spells those by hand.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, Literal

from pipelines.errors import Cancelled, DeadlineExceeded

JobStatus = Literal["queued", "done", "failed", "expired", "cancelled"]
"""Where an async job is: ``queued`` until its request finishes, then ``done`` (with its
result), ``failed``, ``expired`` or ``cancelled`` (with its error and HTTP status)."""
QUEUED: Final = "queued"
DONE: Final = "done"
FAILED: Final = "failed"
EXPIRED: Final = "expired"
CANCELLED: Final = "cancelled"

STATUSES: Final = frozenset({QUEUED, DONE, FAILED, EXPIRED, CANCELLED})
"""Every :data:`JobStatus`."""


class Outcome(StrEnum):
    """A request's outcome at a step (its final reply's, or ``ok`` when handed on).

    A ``StrEnum``: its value is what the wire, the stats labels and the logs carry.
    """

    OK = "ok"
    """Answered with a result."""
    ERROR = "error"
    """A step failed on this item (the reply carries the status it maps to)."""
    EXPIRED = "expired"
    """Its deadline passed first."""
    CANCELLED = "cancelled"
    """Its client went away, or its job was cancelled."""

    @property
    def http_status(self) -> int:
        """The HTTP status it answers with: 200, 504 (:class:`DeadlineExceeded`), 499
        (:class:`Cancelled`); an ``error``'s is its reply's own (500 unless it says)."""
        return _HTTP[self]

    @property
    def job_status(self) -> JobStatus:
        """The status an async job's record takes when its request ends so."""
        return _JOB[self]

    @property
    def stats_field(self) -> str:
        """Its counter in a stage's stats hash: requests the stage ended so, once each."""
        return f"items:{self.value}"


_HTTP = {
    Outcome.OK: 200,
    Outcome.ERROR: 500,
    Outcome.EXPIRED: DeadlineExceeded.status,
    Outcome.CANCELLED: Cancelled.status,
}
_JOB: dict[Outcome, JobStatus] = {
    Outcome.OK: DONE,
    Outcome.ERROR: FAILED,
    Outcome.EXPIRED: EXPIRED,
    Outcome.CANCELLED: CANCELLED,
}
