"""While the model is busy, a batch being assembled gives it time to free before it looks
for new entries (workers/window.py): a fast model's next batch is one read after it frees,
not a look per arrival while it runs; a slow model's fills by a look a pace, never two
looks back to back. What the window does is recorded call by call (its reads and its
waits on the model), so the order is asserted, not a timing."""

from __future__ import annotations

import asyncio
import time

from runtime.redisio import RedisClock
from tests.helpers import number_stage
from workers.lanes import BUSY_BLOCK_MS
from workers.settings import WorkerSettings
from workers.values import Entry
from workers.window import LOOK_PACE_S, Window


class Model:
    """A model that stays busy through ``busy_for`` waits on it, each recorded."""

    def __init__(self, busy_for: int, last_run_s: float) -> None:
        self.left = busy_for
        self.last_run_s = last_run_s
        self.accelerated = False
        self.input_cap = None
        self.calls: list[tuple[str, float | int | None]] = []

    @property
    def busy(self) -> int:
        return 1 if self.left > 0 else 0

    async def freed(self, timeout_s: float) -> None:
        self.calls.append(("freed", timeout_s))
        self.left -= 1
        await asyncio.sleep(0)


def window(model: Model, stopping: asyncio.Event | None = None) -> tuple[Window, list[int]]:
    """A window on ``model`` whose every read brings one new entry; the counts asked."""
    asked: list[int] = []

    async def read(count: int, block_ms: int | None) -> list[Entry]:
        asked.append(count)
        model.calls.append(("read", block_ms))
        ms = int(time.time() * 1000)
        return [Entry(f"{ms}-{len(asked)}".encode(), {}, "s")]

    settings = WorkerSettings(adaptive_batching=False, batch_wait_ms=0)
    stage = number_stage(max_batch_size=8)
    stopping = stopping or asyncio.Event()
    return Window(stage, settings, read, RedisClock(), model, stopping), asked


async def test_a_model_that_frees_within_the_pace_is_never_looked_past() -> None:
    model = Model(busy_for=1, last_run_s=0.0001)
    win, asked = window(model)
    batch = await win.assemble(1000)
    # The model's time to free first, then one read of what came meanwhile.
    assert model.calls == [("freed", LOOK_PACE_S), ("read", 1000)]
    assert asked == [8]
    assert len(batch) == 1


async def test_a_slow_model_is_looked_at_once_a_pace_never_twice_in_a_row() -> None:
    model = Model(busy_for=3, last_run_s=1.0)
    win, _ = window(model)
    batch = await win.assemble(1000)
    pace = BUSY_BLOCK_MS / 1000  # a quarter of a second's call, within the bound
    kinds = [kind for kind, _ in model.calls]
    assert kinds == ["freed", "read", "freed", "read", "freed", "read"]
    assert [t for kind, t in model.calls if kind == "freed"] == [pace] * 3
    assert model.calls[-1] == ("read", None)  # freed: what is left, without waiting
    assert len(batch) == 3


async def test_a_read_that_may_not_wait_does_not_wait_for_the_model_first() -> None:
    model = Model(busy_for=1, last_run_s=0.0001)
    win, _ = window(model)
    await win.assemble(None)  # burst mode's: an empty answer means nothing is left
    assert model.calls[0] == ("read", None)


async def test_the_pace_follows_the_model_s_last_call_within_its_bounds() -> None:
    for last_run_s, pace in ((0.0, LOOK_PACE_S), (0.02, 0.005), (10.0, BUSY_BLOCK_MS / 1000)):
        win, _ = window(Model(busy_for=0, last_run_s=last_run_s))
        assert win.look_pace_s() == pace


async def test_a_model_that_never_frees_does_not_hold_a_stopping_worker() -> None:
    # A hung model (the watchdog ends its process later): the batch being assembled
    # looks once a pace and goes as it is once the worker stops, not when the model frees.
    model = Model(busy_for=10**9, last_run_s=1.0)
    stopping = asyncio.Event()
    win, _ = window(model, stopping)
    freed = model.freed

    async def freed_then_stop(timeout_s: float) -> None:
        await freed(timeout_s)
        if len(model.calls) >= 4:
            stopping.set()

    model.freed = freed_then_stop  # type: ignore[method-assign]
    batch = await asyncio.wait_for(win.assemble(1000), 10)
    assert 1 <= len(batch) < 8
    assert [kind for kind, _ in model.calls][:4] == ["freed", "read", "freed", "read"]
