"""A socket a test opened and left open is that test's error, named at its teardown.

Left open, an asyncio connection outlives the session's event loop; pytest's last garbage
collection then finds it and ends the run with one anonymous error per socket ("loop is
closed"), which names no test (CI, stop 32). Each ``asyncio.StreamWriter`` (what redis-py's
asyncio connections write through) is noted with the test that made it and where; after the
test's fixtures are torn down, one still open is reported against that test.
"""

from __future__ import annotations

import asyncio
import traceback
import weakref
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

_made: list[tuple[weakref.ref[asyncio.StreamWriter], str]] = []
_init = asyncio.StreamWriter.__init__
_ours = str(Path(__file__).resolve().parent.parent)


def _noted_init(self: asyncio.StreamWriter, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    stack = traceback.extract_stack(limit=32)[:-1]
    # The short summary shows one line: the innermost frame of this repository's code.
    mine = [f for f in stack if f.filename.startswith(_ours) and "/.venv/" not in f.filename]
    head = f"{mine[-1].filename[len(_ours) + 1 :]}:{mine[-1].lineno}" if mine else "?"
    _made.append((weakref.ref(self), head + "\n" + "".join(traceback.format_list(stack))))


def _open() -> list[str]:
    still = []
    for ref, where in _made:
        writer = ref()
        if writer is not None and not writer.transport.is_closing():
            still.append(where)
    return still


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    try:
        yield
    finally:
        left = _open()
        _made.clear()
    if left:
        raise AssertionError(
            f"{len(left)} asyncio connection(s) left open, the first made at {left[0]}"
        )


def pytest_configure(config: pytest.Config) -> None:
    asyncio.StreamWriter.__init__ = _noted_init  # type: ignore[method-assign]


def pytest_unconfigure(config: pytest.Config) -> None:
    asyncio.StreamWriter.__init__ = _init  # type: ignore[method-assign]
