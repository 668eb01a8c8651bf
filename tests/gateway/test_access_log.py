"""The access log (gateway/edge.py): one INFO line per request on ``gateway.access``, with
its method, route template, status, milliseconds and request id, as text and as JSON
keys; ``CONVEYOR_ACCESS_LOG=false`` writes none; its lines are written once per loop
iteration (runtime/logs.py), in order with the others."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.logs import (
    TEXT_FORMAT,
    JsonFormatter,
    LineHandler,
    TextFormatter,
    direct_line,
    hold_per_iteration,
    log_line,
)
from tests.helpers import Doubler, GatewayProcess, Harness, number_stage, wait_for_line

ACCESS = "gateway.access"
PLAIN = {"Content-Type": "application/json"}  # a plain sync call: the hot path takes it
ROUTE = {"Content-Type": "application/vnd.test+json"}  # JSON to FastAPI, not to the hot path


def lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The access lines captured so far."""
    return [r for r in caplog.records if r.name == ACCESS]


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields of an access line."""
    return {k: getattr(record, k) for k in ("method", "route", "status", "ms", "request_id")}


async def test_one_line_per_request_with_route_status_ms_and_request_id(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    stage = number_stage(batch_wait_ms=0)
    worker = harness.worker(stage, Doubler())
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([stage])

    fast = await http.post("/v1/double", content=b'{"value": 3}', headers=PLAIN)
    routed = await http.post("/v1/double", content=b'{"value": 4}', headers=ROUTE)
    invalid = await http.post("/v1/double", json={"value": "x"})
    missing = await http.get("/v1/jobs/no-such-job")
    unrouted = await http.get("/nowhere/%0A")  # the path the app sees holds a newline
    assert [r.status_code for r in (fast, routed, invalid, missing, unrouted)] == [
        200,
        200,
        422,
        404,
        404,
    ]

    records = lines(caplog)
    assert len(records) == 5
    got = [fields(r) for r in records]
    assert [(f["method"], f["route"], f["status"]) for f in got] == [
        ("POST", "/v1/double", 200),
        ("POST", "/v1/double", 200),
        ("POST", "/v1/double", 422),
        ("GET", "/v1/jobs/{job_id}", 404),  # the template, not the path
        ("GET", "'/nowhere/\\n'", 404),  # no template: the path, escaped
    ]
    assert [f["request_id"] for f in got] == [
        fast.headers["x-request-id"],
        routed.headers["x-request-id"],
        None,
        None,
        None,
    ]
    assert all(isinstance(f["ms"], float) and 0 <= f["ms"] < 60_000 for f in got)
    assert all(r.levelno == logging.INFO for r in records)
    first = records[0].getMessage()
    assert first.startswith("POST /v1/double 200 ")
    assert first.endswith(f"ms {fast.headers['x-request-id']}")
    assert records[2].getMessage().endswith("ms -")
    # The record is the one Logger.info would make: where the line is written from.
    assert {
        (r.funcName, Path(r.pathname).as_posix().endswith("gateway/edge.py")) for r in records
    } == {("log_access", True)}


async def test_refusals_at_the_edge_are_logged_too(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    http = await harness.gateway([number_stage()], api_keys=["k1"], max_body_bytes=100)
    assert (await http.post("/v1/double", json={"value": 1})).status_code == 401
    big = {"X-API-Key": "k1", **PLAIN}
    assert (await http.post("/v1/double", content=b"1" * 200, headers=big)).status_code == 413
    got = [fields(r) for r in lines(caplog)]
    assert [(f["route"], f["status"]) for f in got] == [("/v1/double", 401), ("/v1/double", 413)]


async def test_the_setting_turns_it_off(harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    on = await harness.gateway([number_stage()])
    off = await harness.gateway([number_stage()], access_log=False)
    for http in (off, on):
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.post("/v1/double", json={"value": "x"})).status_code == 422
    got = [fields(r) for r in lines(caplog)]  # the second gateway's only
    assert [(f["route"], f["status"]) for f in got] == [("/healthz", 200), ("/v1/double", 422)]


def test_json_lines_carry_the_fields_as_keys(redis_url: str, tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    with GatewayProcess(
        redis_url, log, CONVEYOR_LOG_FORMAT="json", CONVEYOR_PIPELINES="chain"
    ) as gw:
        job = httpx.post(f"{gw.base}/v1/jobs/chain", json={"value": 1}, timeout=10)
        assert job.status_code == 202
        assert httpx.get(f"{gw.base}/v1/jobs/nope", timeout=10).status_code == 404
    access = [
        line for line in map(json.loads, log.read_text().splitlines()) if line["logger"] == ACCESS
    ]
    readyz, submitted, missing = access[-3:]  # after the harness's readiness probes
    assert readyz["route"] == "/readyz"
    assert submitted["level"] == "INFO"
    assert {k: submitted[k] for k in ("method", "route", "status", "request_id")} == {
        "method": "POST",
        "route": "/v1/jobs/chain",  # one route per pipeline
        "status": 202,
        "request_id": job.headers["x-request-id"],
    }
    assert isinstance(submitted["ms"], float)
    assert submitted["message"].endswith(f"ms {job.headers['x-request-id']}")
    assert (missing["route"], missing["status"], missing["request_id"]) == (
        "/v1/jobs/{job_id}",
        404,
        None,
    )


class Writes:
    """A stream that keeps each write apart."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass


def held_handler() -> tuple[LineHandler, Writes, logging.Logger, logging.Logger]:
    """A :class:`LineHandler` on a :class:`Writes`, with a logger whose lines it holds
    and one whose lines it does not (neither propagating)."""
    stream = Writes()
    handler = LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    held, plain = logging.getLogger("test.held"), logging.getLogger("test.plain")
    hold_per_iteration(held.name)
    for logger in (held, plain):
        logger.handlers[:] = [handler]
        logger.propagate = False
        logger.setLevel(logging.INFO)
    return handler, stream, held, plain


async def test_held_lines_of_one_loop_iteration_are_one_write_in_order() -> None:
    _, stream, held, plain = held_handler()
    for i in range(5):
        held.info("line %d", i)
    assert stream.writes == []  # held: the iteration has not ended
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert stream.writes == ["".join(f"test.held INFO line {i}\n" for i in range(5))]

    held.info("before")
    held.warning("a warning is written at once, after what is held")
    held.info("after")
    plain.info("another logger's line too")
    assert stream.writes[1:] == [
        "test.held INFO before\ntest.held WARNING a warning is written at once, after what is "
        "held\n",
        "test.held INFO after\ntest.plain INFO another logger's line too\n",
    ]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(stream.writes) == 3  # nothing was left held


def test_off_a_loop_a_held_logger_s_line_is_written_at_once() -> None:
    _, stream, held, _ = held_handler()
    held.info("no loop runs here")
    assert stream.writes == ["test.held INFO no loop runs here\n"]


async def test_flush_writes_what_is_held_as_an_exit_does() -> None:
    handler, stream, held, _ = held_handler()
    held.info("held")
    handler.flush()  # what logging.shutdown() does at exit
    assert stream.writes == ["test.held INFO held\n"]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert stream.writes == ["test.held INFO held\n"]  # the loop's turn found nothing


def test_a_running_gateway_writes_its_access_lines_as_it_answers(
    redis_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "gateway.log"
    with GatewayProcess(redis_url, log, CONVEYOR_PIPELINES="chain") as gw:
        assert gw.proc is not None
        for i in range(3):
            answer = httpx.get(f"{gw.base}/nowhere-{i}", timeout=10)
            assert answer.status_code == 404
            # Written while it runs (at the end of the loop's turn), not only at its exit.
            wait_for_line(log, f"GET /nowhere-{i} 404", gw.proc, limit_s=30)


async def _burst(base: str, n: int, clients: int, going: asyncio.Event | None = None) -> list[str]:
    """``n`` GETs of paths no route has, ``clients`` at a time: the paths answered 404 (a
    client stops at its first failed connection: the gateway is gone). ``going`` is set
    once 200 are answered."""
    answered: list[str] = []
    paths = iter(f"/nowhere-{i}" for i in range(n))
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:

        async def client() -> None:
            for path in paths:
                try:
                    answer = await http.get(path)
                except httpx.TransportError:
                    return
                if answer.status_code == 404:
                    answered.append(path)
                if going is not None and len(answered) >= 200:
                    going.set()

        await asyncio.gather(*(client() for _ in range(clients)))
    return answered


def _access(log: Path) -> list[dict[str, Any]]:
    """The access lines of a JSON log; every line must be whole JSON (none torn)."""
    parsed = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [line for line in parsed if line["logger"] == ACCESS]


def _signalled_mid_burst(
    redis_url: str, log: Path, sig: signal.Signals
) -> tuple[list[str], list[str], int]:
    """A gateway sent ``sig`` once 200 of a 32-client burst are answered: the paths
    answered, the paths of its access lines (the log's every line whole JSON), and its
    exit status."""
    with GatewayProcess(
        redis_url, log, CONVEYOR_LOG_FORMAT="json", CONVEYOR_PIPELINES="chain"
    ) as gw:
        assert gw.proc is not None
        proc = gw.proc

        async def burst_then_signal() -> list[str]:
            going = asyncio.Event()
            burst = asyncio.ensure_future(_burst(gw.base, 100_000, 32, going))
            started = asyncio.ensure_future(going.wait())
            # Lines are being held and written; a burst that ended first says why here.
            await asyncio.wait({burst, started}, timeout=60, return_when=FIRST_COMPLETED)
            started.cancel()
            assert not burst.done(), f"the burst ended first: {burst.result()}"
            assert going.is_set(), "200 answers did not come within 60 s"
            proc.send_signal(sig)
            return await burst

        answered = asyncio.run(burst_then_signal())
        status = proc.wait(timeout=30)
    assert 200 <= len(answered) < 100_000  # signalled in the middle
    written = [line["message"].split()[1] for line in _access(log) if "nowhere" in line["message"]]
    assert len(written) == len(set(written))  # each once
    return answered, written, status


def test_a_stopped_gateway_has_written_every_held_line_once_and_whole(
    redis_url: str, tmp_path: Path
) -> None:
    """An attack on the held lines: SIGTERM in the middle of a burst whose lines are held
    turn after turn. The gateway answers what it has begun before it exits; every answer a
    client got has exactly one line, whole: none is lost in the last turn or at exit."""
    answered, written, status = _signalled_mid_burst(
        redis_url, tmp_path / "gateway.log", signal.SIGTERM
    )
    assert status in (0, -signal.SIGTERM)  # uvicorn raises what it caught, once shut down
    assert set(answered) <= set(written)  # every answer given has its line


def test_a_killed_gateway_leaves_only_whole_lines(redis_url: str, tmp_path: Path) -> None:
    """SIGKILL in the middle of a burst may lose the last turn's held lines (docs/logs.md)
    but leaves no line written twice (a held line written again by a later write), and
    every line whole (each turn's lines are one write: a torn one would fail to parse)."""
    _, written, status = _signalled_mid_burst(redis_url, tmp_path / "gateway.log", signal.SIGKILL)
    assert status == -signal.SIGKILL
    assert written  # some were written before the kill


def direct_logger(formatter: logging.Formatter) -> tuple[LineHandler, Writes, logging.Logger]:
    """A held logger under a root whose one handler is a :class:`LineHandler` with
    ``formatter``, as :func:`~runtime.logs.configure_logging` sets it up (the root's
    handlers are put back by the fixture)."""
    stream = Writes()
    handler = LineHandler(stream)
    handler.setFormatter(formatter)
    logging.getLogger().handlers[:] = [handler]
    logger = logging.getLogger("test.direct.access")
    logger.handlers[:], logger.filters[:] = [], []
    logger.propagate, logger.disabled = True, False
    logger.setLevel(logging.INFO)
    hold_per_iteration(logger.name)
    return handler, stream, logger


@pytest.fixture
def root_kept() -> Iterator[None]:
    """The root's handlers and level, put back after the test."""
    root = logging.getLogger()
    kept, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = kept
        root.setLevel(level)


@pytest.fixture
def new_york(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Local time is New York's (not UTC: a line written in UTC would show)."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        yield
    finally:
        monkeypatch.undo()
        time.tzset()


LINE = "%s %s %d %.1fms %s"
ARGS = ("POST", "/v1/echo", 200, 1.5, "-")
EXTRA = {"method": "POST", "route": "/v1/echo", "status": 200, "ms": 1.5, "request_id": None}
BASE_NS = 1_796_000_000 * 10**9
INSTANTS_NS = [  # second boundaries, milliseconds near 0 and 999, a minute and an hour on
    BASE_NS,
    BASE_NS + 900_000,
    BASE_NS + 122_999_950,
    BASE_NS + 999_500_000,
    BASE_NS + 999_999_999,
    BASE_NS + 10**9,
    BASE_NS + 59_999_000_000,
    BASE_NS + 3_600_500_000_000,
]


def passes(record: logging.LogRecord) -> bool:
    return True


@pytest.mark.usefixtures("root_kept", "new_york")
@pytest.mark.parametrize("formatter", [TextFormatter, JsonFormatter], ids=["text", "json"])
async def test_a_direct_line_is_the_line_its_record_writes_held_as_it_would_be(
    formatter: type[logging.Formatter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same instants for both ways (the clock frozen, as LogRecord and log_line read
    it), the record's way forced by a filter that passes everything."""
    handler, stream, logger = direct_logger(formatter())
    formatted: list[logging.LogRecord] = []
    format_record = handler.format

    def counting(record: logging.LogRecord) -> str:
        formatted.append(record)
        return format_record(record)

    monkeypatch.setattr(handler, "format", counting)
    for ns in INSTANTS_NS:
        monkeypatch.setattr(time, "time_ns", lambda ns=ns: ns)
        monkeypatch.setattr(time, "time", lambda ns=ns: ns / 1e9)
        log_line(logger, logging.INFO, LINE, ARGS, EXTRA)
        assert not formatted  # made directly
        assert stream.writes == []  # held: the loop's turn has not ended
        logger.addFilter(passes)
        log_line(logger, logging.INFO, LINE, ARGS, EXTRA)
        logger.removeFilter(passes)
        assert len(formatted) == 1  # through a record
        formatted.clear()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        (written,) = stream.writes
        direct, by_record = written.splitlines()
        assert direct == by_record, ns
        stream.writes.clear()
        if formatter is TextFormatter:  # and the standard library's own formatter's line
            record = logging.LogRecord(logger.name, logging.INFO, "f.py", 1, LINE, ARGS, None)
            assert direct == logging.Formatter(TEXT_FORMAT).format(record), ns
    moment = time.localtime(BASE_NS / 1e9)  # New York's local time, not UTC
    assert moment.tm_hour != time.gmtime(BASE_NS / 1e9).tm_hour


@pytest.mark.usefixtures("root_kept")
def test_a_line_is_a_record_wherever_something_else_may_see_it(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filter, a second handler (caplog's), a handler's level, another formatter or a
    date format, a record factory, a patched Logger method, another logger class: the
    line is a record, handled as ``Logger.info`` would handle it."""
    handler, stream, logger = direct_logger(TextFormatter())
    assert direct_line(logger, logging.INFO) is handler

    def check(change: Callable[[], object], undo: Callable[[], object]) -> None:
        change()
        assert direct_line(logger, logging.INFO) is None
        undo()
        assert direct_line(logger, logging.INFO) is handler

    check(lambda: logger.addFilter(passes), lambda: logger.removeFilter(passes))
    check(lambda: handler.addFilter(passes), lambda: handler.removeFilter(passes))
    check(lambda: handler.setLevel(logging.WARNING), lambda: handler.setLevel(logging.NOTSET))
    check(
        lambda: handler.setFormatter(logging.Formatter("%(message)s")),
        lambda: handler.setFormatter(TextFormatter()),
    )
    dated = TextFormatter()
    dated.datefmt = "%H:%M:%S"
    check(lambda: handler.setFormatter(dated), lambda: handler.setFormatter(TextFormatter()))
    check(lambda: setattr(logger, "disabled", True), lambda: setattr(logger, "disabled", False))
    between = logging.getLogger("test.direct")
    null = logging.NullHandler()
    check(lambda: between.addHandler(null), lambda: between.removeHandler(null))
    second = LineHandler(Writes())
    root = logging.getLogger()
    check(lambda: root.addHandler(second), lambda: root.removeHandler(second))
    check(lambda: setattr(logger, "propagate", False), lambda: setattr(logger, "propagate", True))
    factory = logging.getLogRecordFactory()
    check(
        lambda: logging.setLogRecordFactory(lambda *a, **k: factory(*a, **k)),
        lambda: logging.setLogRecordFactory(factory),
    )
    call_handlers = logging.Logger.callHandlers
    check(
        lambda: setattr(logging.Logger, "callHandlers", lambda self, r: call_handlers(self, r)),
        lambda: setattr(logging.Logger, "callHandlers", call_handlers),
    )
    other_class = type("Other", (logging.Logger,), {})
    check(
        lambda: setattr(logger, "__class__", other_class),
        lambda: setattr(logger, "__class__", logging.Logger),
    )

    root.addHandler(caplog.handler)  # what caplog does: a second handler
    try:
        assert direct_line(logger, logging.INFO) is None
        log_line(logger, logging.INFO, LINE, ARGS, EXTRA)
    finally:
        root.removeHandler(caplog.handler)
    (record,) = [r for r in caplog.records if r.name == logger.name]
    assert record.getMessage() == "POST /v1/echo 200 1.5ms -"
    this = "test_a_line_is_a_record_wherever_something_else_may_see_it"
    assert (record.__dict__["status"], record.funcName) == (200, this)
    assert "".join(stream.writes).rstrip().endswith("POST /v1/echo 200 1.5ms -")  # written


@pytest.mark.usefixtures("root_kept")
def test_a_line_made_directly_fails_as_logging_would(capsys: pytest.CaptureFixture[str]) -> None:
    """A message without arguments is itself; a mapping fills named fields; arguments
    that do not fit the message are the handler's error (said on stderr), not the
    caller's; a key ``extra`` may not hold is the caller's, as ``Logger.info`` says."""
    _, stream, logger = direct_logger(TextFormatter())
    log_line(logger, logging.WARNING, "100%", (), {})
    log_line(logger, logging.WARNING, "%(a)s and %(b)s", ({"a": 1, "b": 2},), {})
    log_line(logger, logging.WARNING, "%d items", ("many",), {})  # does not fit
    lines = "".join(stream.writes).splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == ["100%", "1 and 2"]
    assert "Logging error" in capsys.readouterr().err
    with pytest.raises(KeyError, match="message"):
        log_line(logger, logging.WARNING, "forged", (), {"message": "forged"})
