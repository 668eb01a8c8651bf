"""How every conveyor process logs: its level and format, set once at its entry point.

The worker, the gateway and ``conveyor up`` (with the children it starts, which inherit
its environment) each call :func:`configure_logging` first, so one pair of variables
governs them all:

- ``CONVEYOR_LOG_LEVEL``: ``DEBUG``, ``INFO`` (default), ``WARNING``, ``ERROR`` or
  ``CRITICAL``, any case.
- ``CONVEYOR_LOG_FORMAT``: ``text`` (default: ``time LEVEL logger: message``) or ``json``:
  one JSON object a line with ``time``, ``level``, ``logger`` and ``message``, and the
  structured fields a call passed as ``extra`` (a batch line's stage, size, outcome
  counts and durations), so a log pipeline reads them without parsing the message.

A line is written as it is logged, except a line of a logger named by
:func:`hold_per_iteration` (the gateway's access line, one a request) logged below
``WARNING`` on a running event loop: it is held until the end of the loop's iteration and
written with the others of that iteration in one write, so that a gateway under load does
not make a system call per request for its log. Any other line writes what is held first,
so lines stay in order; so does an exit.

The model libraries are kept quiet in a worker (:func:`quiet_model_libraries`): their
progress bars are tty decoration, and in a log they are hundreds of carriage-returned
lines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, MutableMapping
from types import TracebackType
from typing import Any, cast

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipelines.settings import load_settings

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The values ``CONVEYOR_LOG_LEVEL`` takes (any case)."""

FORMATS = ("text", "json")
"""The values ``CONVEYOR_LOG_FORMAT`` takes."""

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The line of ``CONVEYOR_LOG_FORMAT=text``."""

# What every LogRecord carries; anything else on a record came from a call's ``extra``.
# ``color_message`` is uvicorn's copy of its message with terminal colours.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "color_message",
    "taskName",
}


_HELD: set[str] = set()
"""The loggers whose lines below WARNING are held to the end of a loop iteration."""


def hold_per_iteration(name: str) -> None:
    """Write the lines below ``WARNING`` that logger ``name`` logs on a running event loop
    once per loop iteration, together (see the module's doc)."""
    _HELD.add(name)


class LineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each line to its stream as it is logged, but holds the lines of the loggers
    :func:`hold_per_iteration` names, logged below ``WARNING`` on a running event loop, to
    the end of that loop iteration (one write for all of them). Any other line, and
    :meth:`flush` (at exit, or by hand), writes what is held first.

    Args:
        stream: where lines go (stderr).
    """

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._held: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        """Write ``record``'s line, or hold it (see the class doc). Called under the
        handler's lock."""
        try:
            self._out(record.name, record.levelno, self.format(record))
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)

    def emit_line(self, name: str, levelno: int, line: str) -> None:
        """Write (or hold, as :meth:`emit` would) ``line``, already formatted, of logger
        ``name`` at ``levelno``: what :func:`direct_line` found this handler would write."""
        self.acquire()
        try:
            self._out(name, levelno, line)
        except Exception:
            self.handleError(logging.makeLogRecord({"name": name, "msg": line}))
        finally:
            self.release()

    def _out(self, name: str, levelno: int, line: str) -> None:
        """Hold ``line`` to the end of the loop's iteration, or write it now."""
        text = line + self.terminator
        if levelno < logging.WARNING and name in _HELD:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                if not self._held:
                    loop.call_soon(self.flush)
                self._held.append(text)
                return
        self._write(text)

    def _write(self, text: str) -> None:
        if self._held:
            text = "".join(self._held) + text
            self._held.clear()
        self.stream.write(text)
        self.stream.flush()

    def flush(self) -> None:
        """Write the lines held, if any, and flush the stream."""
        self.acquire()
        try:
            if self._held:
                try:
                    self._write("")
                except (OSError, ValueError):  # the stream is gone (closed at exit)
                    self._held.clear()
                return
            super().flush()
        finally:
            self.release()


class LogSettings(BaseSettings):
    """How a process logs, read from ``CONVEYOR_LOG_*`` variables (every process reads
    them; the worker's summary interval is [`WorkerSettings`][workers.settings.WorkerSettings]'s).

    Attributes:
        level: the lowest level written: ``DEBUG`` adds each batch's line with its trace
            ids; ``INFO`` writes a summary per stage instead.
        format: ``text`` or ``json`` (one object a line).
    """

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_LOG_", extra="ignore")

    level: str = "INFO"
    format: str = "text"

    @field_validator("level")
    @classmethod
    def _level_ok(cls, value: str) -> str:
        if value.strip().upper() not in LEVELS:
            raise ValueError(f"must be one of {', '.join(LEVELS)} (any case)")
        return value.strip().upper()

    @field_validator("format")
    @classmethod
    def _format_ok(cls, value: str) -> str:
        if value.strip().lower() not in FORMATS:
            raise ValueError(f"must be {' or '.join(FORMATS)}")
        return value.strip().lower()


class TextFormatter(logging.Formatter):
    """``CONVEYOR_LOG_FORMAT=text``: :data:`TEXT_FORMAT`, its time as the standard
    library writes it (local time, ``2026-11-29 17:08:14,834``), the part before the
    milliseconds formatted once a second (again if its ``converter`` or
    ``default_time_format`` changed; a time zone changed by ``time.tzset()`` shows from
    the next second)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._cache: tuple[Any, str] = (None, "")  # one value: read and replaced whole

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """The record's time, as :class:`logging.Formatter` writes it."""
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        return self._time(record.created, record.msecs)

    def _time(self, created: float, msecs: float) -> str:
        key = (int(created), self.converter, self.default_time_format)
        cache = self._cache
        if cache[0] != key:
            cache = (key, time.strftime(self.default_time_format, self.converter(created)))
            self._cache = cache
        msec_format = self.default_msec_format
        return msec_format % (cache[1], msecs) if msec_format else cache[1]

    def line(
        self, name: str, levelname: str, created: float, msecs: float, message: str, extra: Any
    ) -> str:
        """The line :meth:`format` writes of a record with these fields and no
        exception (``extra`` is not written in text)."""
        return f"{self._time(created, msecs)} {levelname} {name}: {message}"


_NOT_EXTRA = _STANDARD | {"time", "level", "logger"}
"""A record's fields the JSON line does not repeat as ``extra`` (its own keys among them)."""


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (UTC, ISO 8601, milliseconds), ``level``,
    ``logger``, ``message``, the record's ``extra`` fields, and ``exc`` (the traceback)
    when it carries an exception. A value JSON cannot hold is written as its ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        line = self._fields(
            record.name, record.levelname, record.created, record.getMessage(), record.__dict__
        )
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)

    def line(
        self,
        name: str,
        levelname: str,
        created: float,
        msecs: float,
        message: str,
        extra: dict[str, Any],
    ) -> str:
        """The line :meth:`format` writes of a record with these fields, ``extra`` its
        own, and no exception."""
        fields = self._fields(name, levelname, created, message, extra)
        return json.dumps(fields, default=str, ensure_ascii=False)

    @staticmethod
    def _fields(
        name: str, levelname: str, created: float, message: str, fields: dict[str, Any]
    ) -> dict[str, Any]:
        """The line's object; of ``fields``, those a record does not carry of itself."""
        return {
            "time": _utc(created),
            "level": levelname,
            "logger": name,
            "message": message,
            **{k: v for k, v in fields.items() if k not in _NOT_EXTRA},
        }


LINE_FORMATTERS = (TextFormatter, JsonFormatter)
"""The formatters whose lines :func:`direct_line` writes without a record."""
LineFormatter = TextFormatter | JsonFormatter


_AS_RECORDS = (
    logging.LogRecord,
    logging.Logger.makeRecord,
    logging.Logger.handle,
    logging.Logger.callHandlers,
)
"""What makes and hands on a record, as the standard library has it: where any is
replaced (a record factory adding trace ids, Sentry's breadcrumbs patching
``callHandlers``), a line is a record, for it to see."""


def direct_line(logger: logging.Logger, levelno: int) -> LineHandler | None:
    """The one handler a line of ``logger`` at ``levelno`` would reach, where writing it
    needs no :class:`logging.LogRecord`: the line is enabled, nothing is on its way that
    could see a record (a filter, another handler on the logger or its parents, a record
    factory or :class:`logging.Logger` method of someone else's, a logger of another
    class) but the root's one :class:`LineHandler`, itself with no filter, and that
    handler's formatter is conveyor's own (:data:`LINE_FORMATTERS`, with no ``datefmt``);
    else None (then log as usual). A record's making and handling cost a gateway about a
    tenth of its CPU per request, for its access line; this check costs a few attribute
    reads."""
    if logger.disabled or logger.filters or not logger.isEnabledFor(levelno):
        return None
    standard = (
        logging.getLogRecordFactory(),
        logging.Logger.makeRecord,
        logging.Logger.handle,
        logging.Logger.callHandlers,
    )
    if type(logger) is not logging.Logger or standard != _AS_RECORDS:
        return None
    found: LineHandler | None = None
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if found is not None or type(handler) is not LineHandler:
                return None
            found = handler
        if not current.propagate:
            break
        current = current.parent
    if found is None or found.filters or levelno < found.level:
        return None
    formatter = found.formatter
    if type(formatter) not in LINE_FORMATTERS or cast(LineFormatter, formatter).datefmt:
        return None
    return found


def log_line(
    logger: logging.Logger, levelno: int, msg: str, args: tuple[Any, ...], extra: dict[str, Any]
) -> None:
    """Log ``msg % args`` with ``extra`` on ``logger``, as ``logger.log(levelno, msg,
    *args, extra=extra)`` would from the caller's line, but cheaply: where
    :func:`direct_line` finds its one handler, the line is made and written without a
    record (the same line, held or written as its record would be); else, and wherever
    making it fails (a message its arguments do not fit, a key ``extra`` may not hold),
    the record is made, without the standard library's walk up the stack for the caller
    (it is the caller of this function), and handled as usual: an error so goes where
    the standard library sends it."""
    handler = direct_line(logger, levelno)
    # An extra key a record carries of itself (makeRecord refuses most of them) takes
    # the record's way, to be refused or handled as the standard library does.
    if handler is not None and _STANDARD.isdisjoint(extra):
        try:
            created, msecs = _now()
            level = logging.getLevelName(levelno)
            message = _message(msg, args)
            formatter = cast(LineFormatter, handler.formatter)
            text = formatter.line(logger.name, level, created, msecs, message, extra)
        except Exception:  # the record's way says it as the standard library would
            pass
        else:
            handler.emit_line(logger.name, levelno, text)
            return
    if not logger.isEnabledFor(levelno):
        return
    caller = sys._getframe(1)
    where = (caller.f_code.co_filename, caller.f_lineno)
    record = logger.makeRecord(
        logger.name, levelno, *where, msg, args, None, caller.f_code.co_name, extra
    )
    logger.handle(record)


def _message(msg: str, args: tuple[Any, ...]) -> str:
    """:meth:`logging.LogRecord.getMessage` of a record of ``msg`` and ``args``."""
    text = str(msg)
    if not args:
        return text
    if len(args) == 1 and isinstance(args[0], Mapping) and args[0]:
        return text % args[0]
    return text % args


def _now() -> tuple[float, float]:
    """``created`` and ``msecs`` of a record made now, as this Python's
    :class:`logging.LogRecord` sets them (from 3.13 on, from ``time.time_ns()``)."""
    if sys.version_info >= (3, 13):
        ns = time.time_ns()
        created = ns / 1e9
        msecs = (ns % 1_000_000_000) // 1_000_000 + 0.0
        if msecs == 999.0 and int(created) != ns // 1_000_000_000:
            msecs = 0.0  # as LogRecord: rounding made created the next second
        return created, msecs
    created = time.time()
    return created, int((created - int(created)) * 1000) + 0.0


def _utc(created: float) -> str:
    whole = int(created)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    return f"{stamp}.{int((created - whole) * 1000):03d}Z"


def configure_logging(**values: str) -> LogSettings:
    """Set up the root logger as ``CONVEYOR_LOG_LEVEL`` and ``CONVEYOR_LOG_FORMAT`` say
    (``values`` over them): one handler on stderr; Python's warnings logged through it;
    in JSON, an uncaught exception's traceback too, so every line stays an object.
    Called once at each entry point; a second call replaces the first's handler.

    Args:
        values: ``level`` or ``format`` given otherwise (a test, a flag).

    Raises:
        ConfigError: a value is not one of those listed, named by its variable.
    """
    settings = load_settings(LogSettings, **values)
    handler = LineHandler(sys.stderr)
    if settings.format == "json":
        handler.setFormatter(JsonFormatter())
        sys.excepthook = _log_uncaught
    else:
        handler.setFormatter(TextFormatter())
    logging.basicConfig(level=settings.level, handlers=[handler], force=True)
    logging.captureWarnings(True)
    # One line per HTTP request a client makes (up's readiness probes, every second):
    # DEBUG material, whatever level httpx itself gives it.
    logging.getLogger("httpx").setLevel(logging.NOTSET if settings.level == "DEBUG" else "WARNING")
    logging.getLogger("httpcore").setLevel("INFO")  # its DEBUG is each socket operation
    return settings


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("conveyor").critical("uncaught exception", exc_info=(kind, exc, tb))


def quiet_model_libraries(environ: MutableMapping[str, str]) -> None:
    """Keep transformers' and huggingface_hub's progress bars ("Loading weights",
    downloads) and their INFO chatter out of a worker's log: set before either is
    imported (``HF_HUB_DISABLE_PROGRESS_BARS``, ``TRANSFORMERS_VERBOSITY``; what
    ``environ`` sets already wins), then :func:`adopt_library_loggers` once imported."""
    environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    environ.setdefault("TRANSFORMERS_VERBOSITY", "warning")


def adopt_library_loggers() -> None:
    """If transformers is imported: its progress bars off, its verbosity ``WARNING`` and
    its lines through conveyor's handler (it installs its own, which writes plain text
    past the root's format). Not imported: nothing (importing it costs a light worker
    a second and a half). Idempotent."""
    if "transformers" not in sys.modules:
        return
    from transformers.utils import logging as hf_logging

    if os.environ.get("TRANSFORMERS_VERBOSITY") in (None, "warning"):
        hf_logging.set_verbosity_warning()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
