"""Stages for fault tests, served by real worker processes (``CONVEYOR_APP``)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, field_validator

from pipelines.graph import Pipeline, function, single
from pipelines.model import Item, Result
from pipelines.stages import Stage, TextIn
from tests.helpers import REPO, NumberIn


class ShortByOne:
    """Breaks the batch contract: one result short for a batch of two or more; a string,
    not a JSON object, for an item of value -1; right otherwise."""

    def predict(self, items: list[Item]) -> list[Result]:
        """Double each value, one result short when there are several."""
        out: list[Any] = [
            "not an object" if i["value"] == -1 else {"value": i["value"] * 2} for i in items
        ]
        return out[:-1] if len(items) >= 2 else out


class Sleepy:
    """Doubles values after sleeping ``CONVEYOR_TEST_DELAY_S`` per batch (model time)."""

    def __init__(self, **options: Any) -> None:
        self.delay_s = float(os.environ.get("CONVEYOR_TEST_DELAY_S", "0"))

    def predict(self, items: list[Item]) -> list[Result]:
        """Sleep, then double."""
        time.sleep(self.delay_s)
        return [{"value": item["value"] * 2} for item in items]


class Crashy:
    """Doubles values; a negative value kills the whole worker process, as a segfault or
    an out-of-memory kill would; -2 ends it with ``os._exit(2)``, the status of a
    configuration error, which a user's code can produce but must not be believed."""

    def __init__(self, **options: Any) -> None:
        del options

    def predict(self, items: list[Item]) -> list[Result]:
        """Double, or die."""
        if any(item["value"] == -2 for item in items):
            os._exit(2)
        if any(item["value"] < 0 for item in items):
            os.kill(os.getpid(), signal.SIGKILL)
        return [{"value": item["value"] * 2} for item in items]


class Hangs:
    """Doubles values; a batch holding -1 never returns (a call no deadline stops)."""

    def __init__(self, **options: Any) -> None:
        del options

    def predict(self, items: list[Item]) -> list[Result]:
        """Double, or hang."""
        if any(item["value"] == -1 for item in items):
            time.sleep(3600)
        return [{"value": item["value"] * 2} for item in items]


class Recorder:
    """Doubles values, writing each one it ran as a line of the file
    ``CONVEYOR_TEST_RECORD`` names (appended, so a restarted worker adds to it); first
    it waits, while the file ``CONVEYOR_TEST_GATE`` names (if set) does not exist, then
    sleeps ``CONVEYOR_TEST_DELAY_S`` per batch. A negative value kills the process, as
    :class:`Crashy`'s does, before anything is written."""

    def __init__(self, **options: Any) -> None:
        self.record = Path(os.environ["CONVEYOR_TEST_RECORD"])
        gate = os.environ.get("CONVEYOR_TEST_GATE")
        self.gate = Path(gate) if gate else None
        self.delay_s = float(os.environ.get("CONVEYOR_TEST_DELAY_S", "0"))

    def predict(self, items: list[Item]) -> list[Result]:
        """Wait for the gate, sleep, record, double (or die)."""
        if any(item["value"] < 0 for item in items):
            os.kill(os.getpid(), signal.SIGKILL)
        while self.gate is not None and not self.gate.exists():
            time.sleep(0.05)  # a test opens the gate from another process
        time.sleep(self.delay_s)
        with self.record.open("a") as out:
            out.writelines(f"{item['value']}\n" for item in items)
        return [{"value": item["value"] * 2} for item in items]


class Doomed:
    """A model whose loading always fails: it raises (the worker exits 2, a configuration
    error), or with ``CONVEYOR_TEST_DOOM=kill`` its worker is killed (SIGKILL, as the OOM
    killer would) at every start."""

    def __init__(self, **options: Any) -> None:
        if os.environ.get("CONVEYOR_TEST_DOOM") == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("this model never loads")

    def predict(self, items: list[Item]) -> list[Result]:
        """Never reached."""
        raise AssertionError


class SlowTexts:
    """Answers each text's length after sleeping ``CONVEYOR_TEST_DELAY_S`` per batch."""

    def __init__(self, **options: Any) -> None:
        self.delay_s = float(os.environ.get("CONVEYOR_TEST_DELAY_S", "0"))

    def predict(self, items: list[Item]) -> list[Result]:
        """Sleep, then measure."""
        time.sleep(self.delay_s)
        return [{"n": len(item["text"])} for item in items]


SLOW = Stage("slow", NumberIn, "tests.support.faultapp:Sleepy", max_batch_size=32, batch_wait_ms=50)
TEXTS = Stage(
    "texts", TextIn, "tests.support.faultapp:SlowTexts", batch_wait_ms=50, max_batch_tokens=8192
)
"""Length-aware: a window of short and long texts runs as two batches, back to back."""
CRASHY = Stage(
    "crashy", NumberIn, "tests.support.faultapp:Crashy", max_batch_size=16, batch_wait_ms=300
)
HANGS = Stage("hangs", NumberIn, "tests.support.faultapp:Hangs", batch_wait_ms=300, max_call_s=2)


def _pass_on(payload: dict[str, Any]) -> dict[str, Any]:
    return {"value": payload["value"]}


def _slow_pass_on(payload: dict[str, Any]) -> dict[str, Any]:
    mark = os.environ.get("CONVEYOR_TEST_STARTED")
    if mark:  # lets a test know the step is running, not only read
        Path(mark).touch()
    time.sleep(float(os.environ.get("CONVEYOR_TEST_STEP_S", "1")))
    return {"value": payload["value"]}


CHAIN = Pipeline(
    "chain3",
    NumberIn,
    (
        function("a", _pass_on, then="b"),
        function("b", _slow_pass_on, then="c"),
        function("c", _pass_on),
    ),
)
"""Three function steps, the middle one slow (``CONVEYOR_TEST_STEP_S`` per item; it touches
the file ``CONVEYOR_TEST_STARTED`` names, if set, as it starts)."""

RECORDED = Stage(
    "recorded", NumberIn, "tests.support.faultapp:Recorder", max_batch_size=4, batch_wait_ms=20
)

pipelines: list[Pipeline] = [single(SLOW), single(CRASHY), single(TEXTS), CHAIN, single(HANGS)]

kept: list[Pipeline] = [single(RECORDED), single(CRASHY)]
"""A stage that records every value it ran (:class:`Recorder`) beside the crashing one:
``--app tests.support.faultapp:kept``."""

doomed: list[Pipeline] = [single(Stage("doomed", NumberIn, "tests.support.faultapp:Doomed"))]
"""A pipeline whose worker crashes at every start (``--app tests.support.faultapp:doomed``)."""

doomed_beside_chain: list[Pipeline] = [*doomed, CHAIN]
"""The doomed pipeline beside a healthy one in a process of its own (its function stages):
``--app tests.support.faultapp:doomed_beside_chain``."""


class Kind(BaseModel):
    """What a user-code step does: ``ok`` answers, ``hang`` never returns, any key of
    :data:`RAISED` raises that."""

    kind: str = "ok"


RAISED: dict[str, Callable[[], BaseException]] = {
    "exit2": lambda: SystemExit(2),
    "exit0": lambda: SystemExit(0),
    "interrupt": KeyboardInterrupt,
    "bare": lambda: BaseException("bare"),
    "generator": GeneratorExit,
    "cancelled": asyncio.CancelledError,
}
"""What a step of :data:`user_code` can be asked to raise: none of them an ``Exception``."""


def _sync_step(payload: dict[str, Any]) -> dict[str, Any]:
    kind = payload["kind"]
    if kind == "hang":
        time.sleep(3600)  # a call no deadline stops
    if kind in RAISED:
        raise RAISED[kind]()
    return {"kind": kind}


def _pass_kind(payload: dict[str, Any]) -> dict[str, Any]:
    return {"kind": payload["kind"]}


async def _async_step(payload: dict[str, Any]) -> dict[str, Any]:
    kind = payload["kind"]
    if kind == "hang":
        await asyncio.Event().wait()  # awaits forever, unless cancelled
    if kind in RAISED:
        raise RAISED[kind]()
    return {"kind": kind}


def _raising_route(output: dict[str, Any], ctx: dict[str, Any]) -> str:
    where, _, kind = output["kind"].partition(":")
    if where == "route":
        raise RAISED[kind]()
    return "next"


def _raising_input(ctx: dict[str, Any]) -> dict[str, Any]:
    where, _, kind = ctx["input"]["kind"].partition(":")
    if where == "input":
        raise RAISED[kind]()
    return {"kind": "ok"}


class Touchy(BaseModel):
    """An input model whose validator raises what :data:`RAISED` names (in the gateway,
    before anything is enqueued)."""

    kind: str

    @field_validator("kind")
    @classmethod
    def _raise(cls, kind: str) -> str:
        if kind in RAISED:
            raise RAISED[kind]()
        return kind


user_code: list[Pipeline] = [
    Pipeline("touchy", Touchy, (function("run", _pass_kind),)),
    Pipeline("raises", Kind, (function("run", _sync_step),)),
    Pipeline("araises", Kind, (function("run", _async_step),)),
    Pipeline(
        "routes",
        Kind,
        (
            function("first", _pass_kind, route=_raising_route, routes_to=("next",)),
            function("next", _pass_kind, input=_raising_input),
        ),
    ),
]
"""User code that raises what is no ``Exception`` or never returns, as a sync function
step (stage ``raises.run``) and an async one (``araises.run``), each on :class:`Kind`
(``--app tests.support.faultapp:user_code``); in ``routes`` the route of its first step raises
for ``route:<RAISED key>``, the next step's input function for ``input:<key>``."""


def spawn(module: str, *args: str, log: Path | None = None, **env: str) -> subprocess.Popen[bytes]:
    """A real ``python -m module ARGS`` serving this file's stages from this checkout, with
    the test's environment plus ``env``; its output goes to ``log`` (appended) if given."""
    full = dict(os.environ) | {
        "CONVEYOR_APP": "tests.support.faultapp:pipelines",
        "PYTHONPATH": str(REPO),
    }
    argv = [sys.executable, "-m", module, *args]
    if log is None:
        return subprocess.Popen(argv, env=full | env, cwd=REPO)
    with log.open("ab") as out:
        return subprocess.Popen(
            argv, env=full | env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End a process a test started (SIGTERM, then SIGKILL)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
