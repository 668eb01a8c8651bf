"""The exceptions conveyor raises, each with the HTTP status it maps to.

The status lives on the class (``status``), so the gateway maps a local error and a
worker maps a failed item the same way: [`http_status`][].
"""

from __future__ import annotations

import re
import sysconfig
import traceback
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from http import HTTPStatus

RETRY_AFTER_MAX_S = 3600
"""The longest Retry-After a client is told, whatever a step or an upstream said."""

# ASCII only: str.isdigit() and int() also take "²" or "٣", which no HTTP peer means.
_DELAY_SECONDS = re.compile(r"[0-9]+")


class ConveyorError(Exception):
    """Base of every conveyor error; its message says what to do about it.

    Args:
        message: what happened and what to do.
        request_id: the request it concerns, when there is one.
        retry_after: seconds to wait before retrying, when retrying later can help (the
            gateway sends it as ``Retry-After``).
    """

    status = 500
    request_id: str | None = None
    retry_after: float | None = None
    """Declared on the class too, like ``status``: a subclass may set a default there, and
    one whose ``__init__`` skips this one's still has both."""

    def __init__(
        self, message: str, *, request_id: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        if request_id is not None:
            self.request_id = request_id
        if retry_after is not None:
            self.retry_after = retry_after


def retry_after_s(header: str | None, now: datetime | None = None) -> float | None:
    """The seconds a ``Retry-After`` header asks for, within 0 and [`RETRY_AFTER_MAX_S`][];
    None when it is absent or is not what RFC 9110 allows (ASCII digits, or an HTTP-date).

    The header comes from another server: nothing it holds may raise here.

    Args:
        header: the header's value, as received.
        now: the time an HTTP-date is counted from (default: now).
    """
    value = (header or "").strip(" \t")
    if _DELAY_SECONDS.fullmatch(value):
        digits = value.lstrip("0") or "0"
        # A longer number is past the bound anyway (and int() refuses past 4,300 digits).
        return float(min(int(digits), RETRY_AFTER_MAX_S) if len(digits) < 10 else RETRY_AFTER_MAX_S)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000": a time in UTC, RFC 5322 says
        when = when.replace(tzinfo=UTC)
    wait = (when - (now or datetime.now(UTC))).total_seconds()
    return min(max(wait, 0.0), float(RETRY_AFTER_MAX_S))


def http_status(exc: BaseException) -> int:
    """The HTTP status an error maps to: its class's, if one of [`ERROR_STATUSES`][],
    else 500 (anything not a ConveyorError, or one with a status no error answers with:
    a gateway would refuse a reply with it as forged)."""
    status = exc.status if isinstance(exc, ConveyorError) else 500
    return status if status in ERROR_STATUSES else 500


class ConfigError(ConveyorError):
    """A setting, stage or model spec is wrong; the message names it."""


DETAIL_MAX = 4096
"""The most characters of an error message read from Redis (a reply's, a job record's)
that a client is served; the rest is cut, and the cut said ([`bounded_detail`][])."""


def bounded_detail(text: str, limit: int = DETAIL_MAX) -> str:
    """``text``, cut to its first ``limit`` characters, with how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [cut: {len(text) - limit} more characters]"


def one_line(exc: BaseException, limit: int = 400) -> str:
    """``exc`` as one line of a message: its type, its text with the line breaks folded,
    and where it was raised (``file:line``: the innermost frame in neither an installed
    package nor the standard library, so the user's own line), its text cut at
    ``limit`` characters. For errors in a user's code (their module, their model's
    constructor) shown instead of a traceback.

    Args:
        exc: the exception.
        limit: the most characters of its text shown.
    """
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    # The first frame is the one that caught it; where it was raised is further in.
    frames = [f for f in traceback.extract_tb(exc.__traceback__)[1:] if _own(f.filename)]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {text}{where}" if text else f"{type(exc).__name__}{where}"


_NOT_OWN = ("<", sysconfig.get_paths()["stdlib"])  # a frozen module, the standard library


def _own(filename: str) -> bool:
    """Whether ``filename`` is code of the user's or conveyor's: not Python's own (the
    standard library, a frozen module), nor an installed library's."""
    return not filename.startswith(_NOT_OWN) and "-packages/" not in filename


class UnknownStage(ConfigError):
    """No stage, step or pipeline of that name is defined."""

    status = 404


class EnvelopeError(ConveyorError):
    """A stream entry is not a valid conveyor envelope (bad JSON, version or fields)."""


class InvalidInput(ConveyorError):
    """A request, or a step's output, holds something conveyor cannot carry or run.

    Args:
        message: what is wrong, naming where.
        problems: each problem as a validation error (``loc``, ``msg``, ``type``); the
            gateway answers them as FastAPI answers its own 422s.
        request_id: the request it concerns, when there is one.
    """

    status = 422

    def __init__(
        self,
        message: str,
        problems: list[dict[str, object]] | None = None,
        *,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message, request_id=request_id)
        self.problems = problems or []


class BatchContractError(ConveyorError):
    """A model returned a number of results different from the number of items."""


class Overloaded(ConveyorError):
    """A stage's backlog is over its bound; retry after ``retry_after`` seconds."""

    status = 503

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message, retry_after=retry_after)


class PastDeadline(Overloaded):
    """The stage would finish this request only past its deadline (admission's forecast
    from the backlog ahead of it); retry after ``retry_after`` seconds."""


class Unavailable(ConveyorError):
    """Redis cannot be reached; retry after ``retry_after`` seconds."""

    status = 503

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message, retry_after=retry_after)


class DeadlineExceeded(ConveyorError):
    """The request's deadline passed before a result arrived."""

    status = 504


class ItemFailed(ConveyorError):
    """A step failed on this item; the rest of its batch was unaffected.

    Args:
        message: what failed.
        status: the HTTP status the worker mapped the failure to.
        request_id: the request.
        retry_after: seconds, when the failure is worth retrying later.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 500,
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, request_id=request_id, retry_after=retry_after)
        self.status = status


class NotFound(ConveyorError):
    """Nothing matches what was asked for (e.g. no Wikipedia article); retrying will not help."""

    status = 404


class UpstreamUnavailable(ConveyorError):
    """A service conveyor calls (e.g. Wikipedia) is unreachable, slow or answering errors.

    Args:
        message: which service, and what went wrong (unreachable, timed out, HTTP status...).
        retry_after: seconds to wait before retrying.
        request_id: the request it concerns, when there is one.
    """

    status = 503

    def __init__(
        self, message: str, *, retry_after: float = 5.0, request_id: str | None = None
    ) -> None:
        super().__init__(message, request_id=request_id, retry_after=retry_after)


class Cancelled(ConveyorError):
    """The request was cancelled: its client went away, or its job was cancelled. No step
    starts it any more; a batch already running it finishes, and its output is discarded."""

    status = 499  # "client closed request" (nginx's): no standard status says it


class BadReply(ConveyorError):
    """A reply from a worker could not be read: malformed, or not a reply conveyor's
    workers write (an undocumented status, a body that does not match it). Nothing a
    client can fix; the gateway logs it."""

    status = 502


ERROR_STATUSES = frozenset(
    {s.value for s in HTTPStatus if 400 <= s.value < 600} | {Cancelled.status, BadReply.status}
)
"""The HTTP statuses a request that reached a worker may fail with: conveyor's own errors'
(404, 422, 499, 500, 502, 503, 504: the README's HTTP API lists each), and any other
standard 4xx or 5xx a step's own [`ConveyorError`][] subclass declares (a 429 for a
quota). A reply's ``status`` holds one of them when it is not ``ok``; a step's error with
any other status answers 500."""
