"""The records gateway and workers both keep in Redis, each with its one schema.

An async job's record is the hash at ``Keys.job(id)``: its fields and the JSON keys the
gateway serves it under are the same names (:class:`JobField`), its statuses are
:data:`~pipelines.outcomes.JobStatus`. What each writer sets is built here
(:func:`job_created`, :func:`job_finished`, :func:`job_cancelled`; the commands that
write them are :mod:`runtime.jobs` and the publish script), and what is read back is
parsed and served here (:meth:`JobRecord.parse`, :meth:`JobRecord.view`, which is what
conveyor's client reads).

A dead letter is an entry of ``Keys.dead_letters(stage)``: a stage entry's fields (the
envelope untouched, so it can be replayed) plus what :class:`DeadLetter` adds: where it
came from, how often it was delivered and why it stopped. A worker writes it,
``conveyor dlq`` reads it. Why a stage's workers are parked is :class:`Parked`.

This module imports nothing heavy: conveyor's client (an SDK) reads the job JSON with it.
"""

from __future__ import annotations

import hmac
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

import orjson

from pipelines.errors import ERROR_STATUSES, BadReply, Cancelled, DeadlineExceeded, bounded_detail
from pipelines.outcomes import CANCELLED, DONE, EXPIRED, FAILED, QUEUED, STATUSES

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

    from pipelines.envelope import Reply, Request

logger = logging.getLogger(__name__)

INVALID_ERROR = "the job's record could not be read"
"""The error of a job whose record holds what no worker writes (see :meth:`JobRecord.view`)."""

EXPIRED_ERROR = "deadline passed before the job finished"
"""The error of a job still queued when its deadline passed (see :meth:`JobRecord.view`)."""


class JobField:
    """The names of a job record's fields: in its Redis hash, and as keys of the JSON the
    gateway serves for it (``GET /v1/jobs/{id}``)."""

    ID: Final = "id"
    """JSON only: the job's id (the hash's key holds it)."""
    STATUS: Final = "status"
    """A :data:`~pipelines.outcomes.JobStatus`."""
    PIPELINE: Final = "pipeline"
    """The pipeline the job was submitted to."""
    OWNER: Final = "owner"
    """Hash only: who submitted it (the API key's identity), the only one who may read it."""
    DEADLINE: Final = "deadline"
    """Hash only: when it expires unless finished (Redis clock, seconds since the epoch)."""
    RESULT: Final = "result"
    """Once done: the result (JSON text in the hash)."""
    ERROR: Final = "error"
    """Once failed or expired: a client-safe message."""
    HTTP_STATUS: Final = "http_status"
    """Once finished: the status the synchronous call would have answered."""


def job_created(request: Request, owner: str) -> dict[FieldT, EncodableT]:
    """A new job record's fields but its status (``queued``, written only where there is
    none: :func:`runtime.jobs.create_job`).

    Args:
        request: the job's request (its ``reply_to`` is the record's key).
        owner: who submits the job (the API key's identity).
    """
    return {
        JobField.OWNER: owner,
        JobField.PIPELINE: request.pipeline,
        JobField.DEADLINE: repr(request.deadline),
    }


def job_finished(reply: Reply) -> dict[FieldT, EncodableT]:
    """A job record's fields once its request has finished with ``reply`` (set over the
    fields :func:`job_created` wrote)."""
    code = str(reply.http_status)
    # A job never streams; a partial reply (which no worker sends one) would not finish it.
    status = FAILED if reply.outcome == "partial" else reply.outcome.job_status
    if status == DONE:
        result = orjson.dumps(reply.result).decode()
        return {JobField.STATUS: status, JobField.RESULT: result, JobField.HTTP_STATUS: code}
    return {JobField.STATUS: status, JobField.ERROR: reply.error or "", JobField.HTTP_STATUS: code}


CANCELLED_ERROR = "cancelled"
"""The error of a cancelled job (see :class:`~pipelines.errors.Cancelled`)."""


def job_cancelled() -> dict[FieldT, EncodableT]:
    """A job record's fields once it is cancelled before it finished."""
    code = str(Cancelled.status)
    return {JobField.STATUS: CANCELLED, JobField.ERROR: CANCELLED_ERROR, JobField.HTTP_STATUS: code}


def _str(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _json_object(text: str | None) -> dict[str, Any] | None:
    """``text`` as a JSON object, or None if it is absent or anything else."""
    if text is None:
        return None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class JobRecord:
    """A job record as read back from its hash (:class:`JobField` says what each field
    holds); a field never written is None."""

    status: str | None = None
    pipeline: str | None = None
    owner: str | None = None
    deadline: float | None = None
    result: str | None = None
    error: str | None = None
    http_status: int | None = None
    unreadable: str | None = None
    """Why a field that was written could not be parsed (the record is served as
    :data:`INVALID_ERROR`), or None."""

    @classmethod
    def parse(cls, raw: Mapping[Any, Any]) -> JobRecord:
        """The record in ``raw`` (what HGETALL answers: empty when there is none). Never
        raises: a record is writable by anyone who can enqueue, so a field that does not
        parse is noted in ``unreadable`` for :meth:`view` to answer."""
        fields = {_str(k): _str(v) for k, v in raw.items()}
        deadline, code = fields.get(JobField.DEADLINE), fields.get(JobField.HTTP_STATUS)
        unreadable: list[str] = []
        try:
            when = None if deadline is None else float(deadline)
        except ValueError:
            when, unreadable = None, [*unreadable, JobField.DEADLINE]
        if when is not None and not math.isfinite(when):
            when, unreadable = None, [*unreadable, JobField.DEADLINE]
        try:
            status = None if code is None else int(code)
        except ValueError:
            status, unreadable = None, [*unreadable, JobField.HTTP_STATUS]
        return cls(
            status=fields.get(JobField.STATUS),
            pipeline=fields.get(JobField.PIPELINE),
            owner=fields.get(JobField.OWNER),
            deadline=when,
            result=fields.get(JobField.RESULT),
            error=fields.get(JobField.ERROR),
            http_status=status,
            unreadable=", ".join(unreadable) or None,
        )

    def readable_by(self, owner: str) -> bool:
        """Whether ``owner`` (an API key's identity) may read the job: only its owner may.

        A record with a pipeline and no owner was written before jobs had owners: it stays
        readable as it was (for at most its TTL). One with neither is a worker's late write
        after the record expired: nobody's.
        """
        holder = self.owner
        if holder is None:
            holder = owner if self.pipeline is not None else ""
        return hmac.compare_digest(holder.encode(), owner.encode())

    def view(self, job_id: str, now: float) -> dict[str, Any]:
        """The JSON served for the job at ``now`` (Redis clock): its status, and its result
        or its error and HTTP status once finished. A job still queued past its deadline
        is expired (504), as its synchronous call would have been answered.

        A record that holds what no worker writes (an unknown status, a result that is not
        a JSON object, an HTTP status the API does not document or that contradicts the
        job's status) is served ``failed`` with :data:`INVALID_ERROR` and 502, and logged:
        as the gateway answers a reply it cannot trust."""
        status, error, code = self.status, self.error, self.http_status
        if status == QUEUED and self.deadline is not None and self.deadline < now:
            status, error, code = EXPIRED, EXPIRED_ERROR, DeadlineExceeded.status
        out: dict[str, Any] = {JobField.ID: job_id, JobField.PIPELINE: self.pipeline}
        out[JobField.STATUS] = status
        problem = self.unreadable and f"unreadable {self.unreadable}"
        if problem is None and status not in STATUSES:
            problem = "unknown status"
        elif problem is None and status == DONE:
            result = _json_object(self.result)
            out[JobField.RESULT] = result
            if result is None:
                problem = "a result that is not a JSON object"
            elif code not in (None, 200):
                problem = f"http_status {code} for a done job"
        elif problem is None and status != QUEUED:
            out[JobField.ERROR] = bounded_detail(error or "")
            out[JobField.HTTP_STATUS] = 500 if code is None else code
            if code is not None and code not in ERROR_STATUSES:
                problem = f"http_status {code} for a {status} job"
        if problem is None:
            return out
        logger.warning("job %s: its record is invalid (%s); served as 502", job_id, problem)
        return {
            JobField.ID: job_id,
            JobField.PIPELINE: self.pipeline,
            JobField.STATUS: FAILED,
            JobField.ERROR: INVALID_ERROR,
            JobField.HTTP_STATUS: BadReply.status,
        }


@dataclass(frozen=True)
class DeadLetter:
    """What a dead letter adds to its stage entry's fields; a field never written is None.

    Attributes:
        entry: the entry's id in its stage stream.
        deliveries: how many times it was delivered.
        error: why it stopped.
    """

    PREFIX: ClassVar[bytes] = b"dlq:"
    """Every added field's name starts so; the entry's own fields never do."""
    ENTRY: ClassVar[bytes] = PREFIX + b"entry"
    DELIVERIES: ClassVar[bytes] = PREFIX + b"deliveries"
    ERROR: ClassVar[bytes] = PREFIX + b"error"

    entry: bytes | str | None = None
    deliveries: int | None = None
    error: str | None = None

    def fields(self) -> dict[FieldT, EncodableT]:
        """The fields to add to the entry's (those given)."""
        named: dict[FieldT, EncodableT | None] = {
            self.ENTRY: self.entry,
            self.DELIVERIES: self.deliveries,
            self.ERROR: self.error,
        }
        return {name: value for name, value in named.items() if value is not None}

    @classmethod
    def parse(cls, fields: Mapping[Any, Any]) -> DeadLetter:
        """What the dead letter ``fields`` (as XRANGE answers them) say beyond the entry."""
        deliveries = fields.get(cls.DELIVERIES)
        error = fields.get(cls.ERROR)
        return cls(
            entry=fields.get(cls.ENTRY),
            deliveries=None if deliveries is None else int(deliveries),
            error=None if error is None else _str(error),
        )


@dataclass(frozen=True)
class Parked:
    """Why a stage's workers are parked, and until when: a field of ``Keys.parked()``
    (the stage's name), written by ``conveyor up`` when the stage's worker group crashes
    in a loop (:mod:`conveyor.parks`), read by the gateway (503 + Retry-After),
    ``/status`` and ``/metrics`` through :class:`~runtime.status.StageStatus`.

    Attributes:
        reason: what happened, in a line.
        until: when the group is started again (Unix time, seconds).
    """

    MAX_REASON: ClassVar[int] = 500

    reason: str
    until: float

    def encode(self) -> bytes:
        """The hash field's value."""
        return orjson.dumps({"reason": self.reason[: self.MAX_REASON], "until": self.until})

    MAX_PARK_S: ClassVar[float] = 86_400.0

    def left_s(self, now: float) -> float:
        """Seconds until the group is started again, at ``now`` (Unix time; at most
        :data:`MAX_PARK_S`, the longest park ``up`` allows, whatever the record says)."""
        return min(self.MAX_PARK_S, max(0.0, self.until - now))

    @classmethod
    def parse(cls, raw: bytes | str | None) -> Parked | None:
        """The record in a hash field's value; None for none, or for anything no
        ``conveyor up`` writes (untrusted: whatever the key holds is refused, not
        believed)."""
        if raw is None or len(raw) > 4 * cls.MAX_REASON:
            return None
        value = _json_object(_str(raw))
        if value is None:
            return None
        reason, until = value.get("reason"), value.get("until")
        if not isinstance(reason, str) or isinstance(until, bool):
            return None
        if not isinstance(until, int | float) or not math.isfinite(until) or until <= 0:
            return None
        return cls(reason[: cls.MAX_REASON], float(min(until, 1e10)))
