"""A simulated accelerator: real runners whose device charges a first call per new shape.

On a GPU each new input shape costs a first call (~80 ms for MiniLM on an H100),
and a worker that has not met a shape yet makes a request wait for it. On the CPU that
cost is a few milliseconds, so tests and benchmarks without a GPU would not see the
problem, or its fix. :class:`SimulatedDevice` puts it back: the first call of each
``(rows, tokens)`` shape sleeps ``first_call_s`` (a sleep releases the GIL, as a device's
wait does), and it counts the cold shapes it met. :class:`SimulatedEmbedder` is the real
:class:`~workers.models.hf_embed.Embedder` (real tokenizer, real weights, the same
buckets and warm-up) on such a device, which it reports as an accelerator, so its
buckets are on by default as on a GPU.

:class:`SimulatedAccelerator` is the rest of a GPU's shape, with no model behind it: host
preparation that holds the GIL, a device time that releases it, flat in the batch's size
up to a saturation point (then linear), a first-call cost per new shape, and a device that
runs one batch at a time. It is staged (:class:`~pipelines.model.StagedModel`) and keeps
what it did (:attr:`SimulatedAccelerator.spans`), so a test can see whether the worker
prepared one batch while the device ran another, and a benchmark can set its throughput
against ``1 / max(prepare, device)``. Its launch returns at once, as a GPU's does, unless
the host reads a device value there (a sync: :mod:`workers.models.reads`): then it waits
for the device's work in flight first, as a GPU does, and the host cannot queue batch
n+1 while batch n runs. Given a real staged runner (``runner``), it runs that runner's
phases as its own, so what counts as a read is what the real runner's launch does.

A stage names them like any runner: ``"workers.models.simulated:SimulatedEmbedder"``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from pipelines.model import Item, Result, StagedModel, cold_shape
from pipelines.tokens import estimate
from workers.models.buckets import batch_sizes
from workers.models.hf_embed import Embedder
from workers.models.reads import DeviceReads

Shape = tuple[int, ...]


class SimulatedDevice:
    """Charges ``first_call_s`` the first time it runs a shape, and counts.

    Args:
        first_call_s: the extra cost of a shape's first call (slept, releasing the GIL).

    Attributes:
        calls: how often each shape ran.
        cold: how many calls met a shape for the first time.
    """

    def __init__(self, first_call_s: float = 0.08) -> None:
        if first_call_s < 0:
            raise ValueError(f"first_call_s must be >= 0, got {first_call_s}")
        self.first_call_s = first_call_s
        self.calls: Counter[Shape] = Counter()
        self.cold = 0
        self._lock = threading.Lock()  # stages sharing the weights may call from two threads

    def run(self, shape: Shape) -> None:
        """Account one call of ``shape``; a new shape pays its first-call cost."""
        with self._lock:
            first = shape not in self.calls
            self.calls[shape] += 1
            if first:
                self.cold += 1
        if first:
            time.sleep(self.first_call_s)

    @property
    def shapes(self) -> set[Shape]:
        """Every shape run so far."""
        with self._lock:
            return set(self.calls)


class SimulatedEmbedder(Embedder):
    """:class:`~workers.models.hf_embed.Embedder` on a :class:`SimulatedDevice`.

    Args:
        first_call_s: the device's first-call cost per shape.
        options: the :class:`~workers.models.hf_embed.Embedder`'s (``device`` is where
            the real computation runs, the CPU in tests).

    Attributes:
        sim: the simulated device (its counters are what tests read).
    """

    def __init__(self, *, first_call_s: float = 0.08, **options: Any) -> None:
        self.sim = SimulatedDevice(first_call_s)
        super().__init__(**options)

    @property
    def accelerated(self) -> bool:
        """An accelerator, for the buckets' default."""
        return True

    def forward(self, encoding: Mapping[str, torch.Tensor], padded: bool) -> Any:
        """Charge the device for the batch's shape, then run the real model."""
        self.sim.run(tuple(encoding["input_ids"].shape))
        return super().forward(encoding, padded)


class Span(NamedTuple):
    """One phase of one batch on the simulated accelerator (``time.monotonic()``)."""

    batch: int
    phase: str  # "prepare", "launch" (the host queuing it) or "device"
    start: float
    end: float


class _Prepared(NamedTuple):
    batch: int
    items: list[Item]
    tokens: list[int]
    host: Any  # the runner's prepared batch, if any


class _Launched(NamedTuple):
    batch: int
    items: list[Item]
    tokens: list[int]
    done_at: float
    queued: Any  # the runner's launched batch, if any


def hold_gil(seconds: float) -> None:
    """Python work for ``seconds``: the GIL is held but for the interpreter's switches,
    as a host's tokenizing and padding hold it."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class SimulatedAccelerator:
    """A staged model on a simulated GPU (see the module's docstring).

    A batch's shape is its rows padded to a power of two (up to ``max_rows``) and its
    longest item's tokens (:func:`pipelines.tokens.estimate`) padded to a multiple of 16;
    the device takes ``device_s`` for a shape of up to ``saturation_tokens`` padded tokens,
    and proportionally more past that. Each result is ``{"tokens": n}``, the item's tokens.

    Args:
        prepare_s: host time per batch, holding the GIL.
        device_s: device time per batch up to saturation (a sleep: the GIL is free).
        saturation_tokens: padded tokens a batch may hold before its cost grows.
        first_call_s: the extra device time of a shape's first call.
        max_rows: the most rows a batch is padded to.
        runner: a real staged runner (on the CPU) whose phases run as this device's:
            its prepare after ``prepare_s``, its launch in the launch (each host read of
            a device value there waits for the device), its finish's results are the
            batch's. None: the results are ``{"tokens": n}``.
        model: ignored (every runner is given one).
        options: the other options every runner is given (ignored).

    Attributes:
        spans: each batch's prepare, launch and device spans, in order.
        device_busy_s: total device time charged.
        cold: how many batches met a shape for the first time.
        reads: how many host reads of a device value the launches made.
    """

    def __init__(
        self,
        *,
        prepare_s: float = 0.004,
        device_s: float = 0.008,
        saturation_tokens: int = 4096,
        first_call_s: float = 0.08,
        max_rows: int = 32,
        runner: StagedModel | None = None,
        model: str = "",
        **options: Any,
    ) -> None:
        if min(prepare_s, device_s, first_call_s) < 0 or saturation_tokens < 1:
            raise ValueError("times must be >= 0 and saturation_tokens >= 1")
        self.prepare_s, self.device_s, self.first_call_s = prepare_s, device_s, first_call_s
        self.saturation_tokens = saturation_tokens
        self.rows = batch_sizes(max_rows)
        self.runner = runner
        self.reads = 0
        self.spans: list[Span] = []
        self.device_busy_s = 0.0
        self.cold = 0
        self._shapes: set[tuple[int, int]] = set()
        self._free_at = 0.0  # when the device finishes what it was given
        self._batches = 0
        self._lock = threading.Lock()

    @property
    def accelerated(self) -> bool:
        """An accelerator (a cost flat in tokens is the worker's prior for it)."""
        return True

    def prepare(self, items: list[Item]) -> _Prepared:
        """Host work: the batch's token counts, after ``prepare_s`` holding the GIL (and
        the runner's prepare)."""
        with self._lock:
            self._batches += 1
            batch = self._batches
        start = time.monotonic()
        tokens = [estimate(item) for item in items]
        hold_gil(self.prepare_s)
        host = None if self.runner is None else self.runner.prepare(items)
        self._note(Span(batch, "prepare", start, time.monotonic()))
        return _Prepared(batch, items, tokens, host)

    def launch(self, prepared: _Prepared) -> _Launched:
        """Queue the batch on the device (the runner's launch first); returns at once,
        but for the waits of the host's reads of device values."""
        batch, items, tokens, host = prepared
        launched_at = time.monotonic()
        with DeviceReads(on_read=self._drain) as reads:
            queued = None if self.runner is None else self.runner.launch(host)
        rows = next((r for r in self.rows if r >= len(items)), len(items))
        length = -(-max(tokens, default=1) // 16) * 16
        cost = self.device_s * max(1.0, rows * length / self.saturation_tokens)
        with self._lock:
            if (rows, length) not in self._shapes:
                self._shapes.add((rows, length))
                self.cold += 1
                cost += self.first_call_s
                cold_shape()
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = done_at = start + cost
            self.device_busy_s += cost
            self.reads += len(reads.seen)
            self.spans.append(Span(batch, "launch", launched_at, now))
            self.spans.append(Span(batch, "device", start, done_at))
        return _Launched(batch, items, tokens, done_at, queued)

    def finish(self, launched: _Launched) -> Sequence[Result | BaseException]:
        """Wait for the device (sleeping: the GIL is free), then the results."""
        time.sleep(max(0.0, launched.done_at - time.monotonic()))
        if self.runner is not None:
            return self.runner.finish(launched.queued)
        return [{"tokens": n} for n in launched.tokens]

    def _drain(self) -> None:
        """A host read of a device value: wait (sleeping) until the device has run all
        it was given, as a GPU's sync does."""
        with self._lock:
            free_at = self._free_at
        time.sleep(max(0.0, free_at - time.monotonic()))

    def predict(self, items: list[Item]) -> Sequence[Result | BaseException]:
        """The three phases in one call."""
        return self.finish(self.launch(self.prepare(items)))

    def _note(self, span: Span) -> None:
        with self._lock:
            self.spans.append(span)


class OneCall:
    """A staged model's three phases run as one ``predict`` call, so the worker cannot
    overlap them: the contrast to a staged model (tests, ``bench.overlap``).

    Args:
        staged: the model wrapped.
    """

    def __init__(self, staged: SimulatedAccelerator) -> None:
        self.staged = staged

    def predict(self, items: list[Item]) -> Sequence[Result | BaseException]:
        """``finish(launch(prepare(items)))`` in the calling thread."""
        return self.staged.predict(items)
