"""``python -m bench.access``: a row per format and way, the ``record`` way through a
record (the filter it adds keeps :func:`~runtime.logs.direct_line` from the line), and the
logging set-up it changed put back."""

from __future__ import annotations

import logging
import sys

import pytest

from bench import access as bench_access
from gateway.edge import access
from runtime.logs import direct_line


def test_each_format_and_way_is_measured(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = logging.getLogger()
    kept, level = root.handlers[:], root.level
    seen: list[bool] = []
    measure = bench_access._lines

    async def lines(n: int) -> float:
        seen.append(direct_line(access, logging.INFO) is not None)
        return await measure(n)

    monkeypatch.setattr(bench_access, "_lines", lines)
    # What configure_logging changes for the process, put back after it.
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    libraries = [logging.getLogger(name) for name in ("httpx", "httpcore")]
    levels = [lib.level for lib in libraries]
    root.handlers[:] = []  # basicConfig(force=True) closes what it replaces: not pytest's
    try:
        bench_access.main(["--lines", "50", "--rounds", "1"])
    finally:
        root.handlers[:] = kept
        root.setLevel(level)
        for lib, was in zip(libraries, levels, strict=True):
            lib.setLevel(was)
    rows = [line.split("|")[1:3] for line in capsys.readouterr().out.splitlines()[2:]]
    assert [[cell.strip() for cell in row] for row in rows] == [
        ["text", "direct"],
        ["text", "record"],
        ["json", "direct"],
        ["json", "record"],
    ]
    assert seen == [True, False, True, False]  # made directly; through a record
    assert not access.filters
